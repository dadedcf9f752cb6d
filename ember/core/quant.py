"""Low-precision checkpoint formats: MXFP8 and NVFP4 (``shared/spec/models_and_rl.md`` §6), and the
block-scaled FP8 of the DeepSeek-V3 release.

Checkpoints may ship weights (typically routed experts) quantized; Ember dequantizes them to the
model dtype at load (``ember.core.loading``). Layouts, per weight ``X`` (any leading dims, e.g.
stacked experts ``[E, N, K]``):

* MXFP8 (OCP MX v1.0): ``X.weight`` float8_e4m3fn ``[..., N, K]`` and ``X.weight_scale`` uint8 E8M0
  ``[..., N, K/32]`` (one power-of-two scale per 32 consecutive elements along K):
  ``w = q · 2^(s − 127)``.
* NVFP4 (ModelOpt): ``X.weight`` uint8 ``[..., N, K/2]`` (two E2M1 codes per byte, the even column in
  the low nibble), ``X.weight_scale`` float8_e4m3fn ``[..., N, K/16]`` and the global
  ``X.weight_scale_2`` float32: ``w = e2m1 · weight_scale · weight_scale_2``.
* FP8 with 2-D block scales (DeepSeek-V3, ``quantization_config = {"quant_method": "fp8",
  "weight_block_size": [128, 128]}``): ``X.weight`` float8_e4m3fn ``[..., N, K]`` and
  ``X.weight_scale_inv`` float32 ``[..., ceil(N/b), ceil(K/b)]``, one scale per ``b × b`` tile (the
  last tiles may be partial): ``w = q · scale_inv``. The block size is read off the shapes (the one
  power of two that gives the stored tile counts).

The quantizers implement the spec's reference recipes (MXFP8: OCP floor rule with saturation to
±448; NVFP4: ModelOpt's two-level scales with round-to-nearest-even), so tests can build tiny
quantized checkpoints and re-export can reproduce the stored bytes.
"""

from __future__ import annotations

import torch

MXFP8_BLOCK = 32
NVFP4_BLOCK = 16
E4M3_MAX = 448.0
E2M1_MAX = 6.0
# E2M1 magnitudes by code (bit 3 is the sign)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# companions of a stored weight ``K``: ``K + "_scale"`` (block scales), ``K + "_scale_2"`` (NVFP4's
# global scale); for ``X.weight`` these are ``X.weight_scale`` / ``X.weight_scale_2``
# ``K + "_scale_inv"``: FP8 tile scales (DeepSeek-V3)
SCALE_SUFFIXES = ("_scale", "_scale_2", "_scale_inv")


def _e2m1_table(device: torch.device) -> torch.Tensor:
    pos = torch.tensor(E2M1_VALUES, device=device)
    return torch.cat([pos, -pos])


def dequant_mxfp8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 values of MXFP8 data ``q`` (float8_e4m3fn or its uint8 bits) with E8M0 ``scale``."""
    if q.dtype == torch.uint8:
        q = q.view(torch.float8_e4m3fn)
    if scale.dtype != torch.uint8:
        scale = scale.view(torch.uint8)
    if q.shape[-1] != scale.shape[-1] * MXFP8_BLOCK or q.shape[:-1] != scale.shape[:-1]:
        raise ValueError(f"MXFP8: data {tuple(q.shape)} does not match scales {tuple(scale.shape)} (blocks of 32)")
    if (scale == 0xFF).any():
        raise ValueError("MXFP8: NaN scale code 0xFF")
    s = torch.exp2(scale.to(torch.float32) - 127.0).repeat_interleave(MXFP8_BLOCK, dim=-1)
    return q.to(torch.float32) * s


def dequant_nvfp4(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """fp32 values of NVFP4 ``packed`` (uint8, two codes per byte) with E4M3 block ``scale`` and the
    fp32 ``global_scale``."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"NVFP4: packed data must be uint8, got {packed.dtype}")
    if scale.dtype == torch.uint8:
        scale = scale.view(torch.float8_e4m3fn)
    K = packed.shape[-1] * 2
    if K != scale.shape[-1] * NVFP4_BLOCK or packed.shape[:-1] != scale.shape[:-1]:
        raise ValueError(f"NVFP4: data {tuple(packed.shape)} does not match scales {tuple(scale.shape)} (blocks of 16)")
    s32 = scale.to(torch.float32)
    if torch.isnan(s32).any():
        raise ValueError("NVFP4: NaN block scale")
    lo, hi = packed & 0xF, packed >> 4
    codes = torch.stack([lo, hi], dim=-1).reshape(*packed.shape[:-1], K)
    values = _e2m1_table(packed.device)[codes.long()]
    return values * s32.repeat_interleave(NVFP4_BLOCK, dim=-1) * global_scale.to(torch.float32)


def _tile(n: int, tiles: int) -> int:
    """The power-of-two tile size ``b`` with ``ceil(n / b) == tiles`` (unique; any ``b >= n`` when
    ``tiles == 1``, where every choice gives the same values)."""
    if tiles == 1:
        return 1 << max(0, (n - 1).bit_length())
    b = 1
    while -(-n // b) > tiles:
        b *= 2
    if -(-n // b) != tiles:
        raise ValueError(f"FP8 block scales: {tiles} tiles do not fit {n} rows/columns with a power-of-two block")
    return b


def dequant_fp8_block(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """fp32 values of block-scaled FP8 data ``q`` ``[..., N, K]`` (float8_e4m3fn or its uint8 bits)
    with one fp32 ``scale_inv`` per tile ``[..., ceil(N/b), ceil(K/b)]``."""
    if q.dtype == torch.uint8:
        q = q.view(torch.float8_e4m3fn)
    if q.dim() < 2 or scale_inv.dim() != q.dim() or q.shape[:-2] != scale_inv.shape[:-2]:
        raise ValueError(f"FP8 block scales: data {tuple(q.shape)} does not match scales {tuple(scale_inv.shape)}")
    N, K = q.shape[-2:]
    bn, bk = _tile(N, scale_inv.shape[-2]), _tile(K, scale_inv.shape[-1])
    s = scale_inv.to(torch.float32).repeat_interleave(bn, dim=-2).repeat_interleave(bk, dim=-1)
    return q.to(torch.float32) * s[..., :N, :K]


def quantize_fp8_block(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q float8_e4m3fn, scale_inv float32)`` of ``w`` ``[..., N, K]`` in ``block × block`` tiles,
    DeepSeek's recipe: ``scale_inv = amax(tile) / 448``, ``q = e4m3(w / scale_inv)``."""
    w = w.float()
    N, K = w.shape[-2:]
    tn, tk = -(-N // block), -(-K // block)
    padded = torch.nn.functional.pad(w, (0, tk * block - K, 0, tn * block - N))
    tiles = padded.reshape(*w.shape[:-2], tn, block, tk, block)
    amax = tiles.abs().amax(dim=(-3, -1))
    scale_inv = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    full = scale_inv.repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)[..., :N, :K]
    q = (w / full).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale_inv


def quantize_mxfp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q float8_e4m3fn, scale uint8)`` of ``w`` (last dim a multiple of 32): OCP's rule
    ``e = floor(log2(amax)) − 8``, elements saturated to ±448; all-zero blocks get code 0."""
    w = w.float()
    blocks = w.reshape(*w.shape[:-1], -1, MXFP8_BLOCK)
    amax = blocks.abs().amax(-1)
    e = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp_min(2.0**-126))) - 8, torch.full_like(amax, -127.0))
    code = (e + 127).clamp(0, 254)
    q = (blocks / torch.exp2(code - 127)[..., None]).clamp(-E4M3_MAX, E4M3_MAX)
    return q.reshape(w.shape).to(torch.float8_e4m3fn), code.to(torch.uint8)


def _round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """E2M1 codes of ``x`` (already scaled), round to nearest, ties to the even code, saturating."""
    mag = x.abs().clamp(max=E2M1_MAX)
    table = torch.tensor(E2M1_VALUES, device=x.device)
    dist = (mag[..., None] - table).abs()
    best = dist.min(-1, keepdim=True).values
    tied = dist == best
    # among equally near codes prefer the even one (round half to even)
    pick = torch.where(tied & (torch.arange(8, device=x.device) % 2 == 0), 0, 1) + (~tied) * 2
    idx = pick.argmin(-1)
    return idx + 8 * ((x < 0) & (idx > 0))


def quantize_nvfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(packed uint8, block scale float8_e4m3fn, global scale float32)`` of ``w`` (last dim a
    multiple of 16), ModelOpt's recipe: ``g = amax(w) / (6·448)``, ``s_b = e4m3(amax_b / 6 / g)``."""
    w = w.float()
    g = (w.abs().amax() / (E2M1_MAX * E4M3_MAX)).clamp_min(torch.finfo(torch.float32).tiny)
    blocks = w.reshape(*w.shape[:-1], -1, NVFP4_BLOCK)
    s_b = (blocks.abs().amax(-1) / E2M1_MAX / g).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    denom = s_b.to(torch.float32)[..., None] * g
    codes = _round_e2m1(torch.where(denom > 0, blocks / denom.clamp_min(1e-30), torch.zeros_like(blocks)))
    codes = codes.reshape(*w.shape[:-1], -1, 2).to(torch.uint8)
    packed = codes[..., 0] | (codes[..., 1] << 4)
    return packed, s_b, g.reshape(())


def dequantize(weight: torch.Tensor, companions: dict[str, torch.Tensor]) -> torch.Tensor:
    """Dequantize a stored weight given its ``{suffix: tensor}`` companions (``_scale``,
    ``_scale_2``, ``_scale_inv``): FP8 tiles with ``_scale_inv``, NVFP4 when a global scale is
    present, else MXFP8."""
    if "_scale_inv" in companions:
        return dequant_fp8_block(weight, companions["_scale_inv"])
    scale = companions.get("_scale")
    if scale is None:
        raise ValueError("quantized weight without a _scale companion")
    if "_scale_2" in companions:
        return dequant_nvfp4(weight, scale, companions["_scale_2"])
    return dequant_mxfp8(weight, scale)
