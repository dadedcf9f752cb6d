"""Rollout precision: the sampler's low-precision copy of the base weights (issue 18, item 3).

``ember serve --rollout-precision bf16|fp8|mxfp8`` lets the sampler run the frozen base weights in a
low-precision format while training keeps the model's own weights. :func:`attach` gives every base
projection (the attention and MLP :class:`~ember.core.layers.lora.LoraLinear` modules: not the LM
head, embeddings, norms or routers) and every routed-expert block (:class:`~ember.core.layers.moe.Experts`)
a ``rollout`` attribute holding its quantised copy; :func:`sampling` turns those copies on for the
passes inside it (the sampling engine enters it for each step: prefill and decode). Outside it every
module computes exactly as before: training, ``forward_backward`` and the trainer's logprobs read the
model's weights, which are never modified. LoRA corrections stay in the activation dtype and are added
as usual.

Formats (:mod:`ember.core.quant`):

* ``fp8``: float8 e4m3 with one fp32 ``scale_inv = amax / 448`` per 128 × 128 tile (DeepSeek-V3).
  On a CUDA device of compute capability 9.x, a linear stores only the e4m3 data and tile scales
  (half the bf16 bytes) and multiplies in W8A8 (activations quantised per 1 × 128 block,
  DeepSeek's recipe): up to :data:`~ember.core.kernels.fp8_gemm.SMALL_M` rows (decode) with the
  Triton kernel of :mod:`ember.core.kernels.fp8_gemm`, shaped to stream the weights, above that
  with ``torch.nn.functional.scaled_mm``, whose blockwise kernel was slower than bf16 at decode
  shapes (``bench/fp8_act_quant.py``). Both are self-checked against the dequantised product at
  :func:`attach`; a path whose check or call fails is turned off (the kernel's for scaled_mm's,
  scaled_mm's for dequantising), as is the fp8 copy of a shape that does not fit (``K``/``N`` not
  multiples of 128). On an H200 (torch 2.11) the scaled_mm product is within 2.6 % of the
  dequantised one. The activations are quantised in one Triton launch
  (:mod:`ember.core.kernels.fp8_quant`, bitwise the PyTorch version). Elsewhere (CPU, other GPUs)
  fp8 is quantise-dequantise (QDQ), as below.
  Routed experts too: their e4m3 copies and tile scales are multiplied by the decode-shaped
  expert kernel of :mod:`ember.core.kernels.expert_decode` (rows gathered in the kernel, the
  input quantised per 1 × 128 block), at every row count.
* ``mxfp8``: OCP MX (e4m3 elements, one E8M0 power-of-two scale per 32 along ``K``), always
  quantise-dequantise (no MX tensor cores assumed).

QDQ copies hold the dequantised values in the model dtype, so they cost as many bytes as the
weights they shadow (the sampler's copy doubles the base projections' memory). Under full fine-tuning the copy follows the
trainer: a weight whose storage or version counter changed is quantised again when :func:`sampling`
is entered.

The static CUDA-graph decoder (:mod:`ember.core.sampling.graphs`) decodes with the copies too, and
as it packs the bf16 weights of q/k/v and gate/up into one GEMM per group, it multiplies their
copies laid side by side in one product (:func:`group_product`; the members' copies become views
of the group's tensors), then its route adds the LoRA delta. A copy quantised again bumps
:func:`version`, and the decoder captures its graphs anew.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from ember.core import quant
from ember.core.kernels import expert_decode, fp8_gemm, fp8_quant
from ember.core.layers.lora import LoraLinear, LoraRoute, side_by_side
from ember.core.layers.moe import Experts

log = logging.getLogger("ember.rollout_precision")

PRECISIONS = ("bf16", "fp8", "mxfp8")
FP8_BLOCK = 128
TARGET_CATEGORIES = ("attn", "mlp")  # LoraLinear categories given a rollout copy (not "unembed")


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"rollout precision must be one of {PRECISIONS}, got {precision!r}")
    return precision


class _Switch:
    """Whether the rollout copies of one model are in use (shared by all its copies), and how many
    times a copy was quantised again since it was made (``version``: a captured CUDA graph that
    reads the copies is stale once it changes)."""

    def __init__(self):
        self.depth = 0
        self.version = 0
        self.modules: list[LoraLinear | Experts] = []  # the modules with a copy (set by attach)


def attached(model: nn.Module) -> bool:
    """Whether :func:`attach` gave ``model`` rollout copies (a precision other than bf16)."""
    return "_rollout_switch" in model.__dict__


def version(model: nn.Module) -> int:
    """The model's rollout copies' :attr:`_Switch.version` (0 without :func:`attach`)."""
    switch = model.__dict__.get("_rollout_switch")
    return switch.version if switch is not None else 0


def qdq(w: torch.Tensor, precision: str) -> torch.Tensor:
    """``w`` quantised to ``precision`` and dequantised back to ``w``'s dtype (any leading dims;
    ``[..., N, K]``, blocks along ``K``)."""
    if precision == "fp8":
        return quant.dequant_fp8_block(*quant.quantize_fp8_block(w, FP8_BLOCK)).to(w.dtype)
    if precision == "mxfp8":
        K = w.shape[-1]
        pad = -K % quant.MXFP8_BLOCK
        src = F.pad(w, (0, pad)) if pad else w  # zero columns do not change a block's amax
        return quant.dequant_mxfp8(*quant.quantize_mxfp8(src))[..., :K].to(w.dtype)
    raise ValueError(f"no quantised copy for precision {precision!r}")


def _key(t: torch.Tensor) -> tuple[int, int]:
    """What changes with a weight: its storage (a new tensor) or its version (in place, resize too)."""
    return t.data_ptr(), t._version


def _fp8_capable(device: torch.device) -> bool:
    return (device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9
            and hasattr(F, "scaled_mm") and hasattr(F, "ScalingType"))


def _quantize_act_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 ``x`` ``[M, K]`` with one fp32 scale per 1 × 128 block ``[M, K/128]`` (row-major): the
    PyTorch version (CPU, and the reference of :func:`ember.core.kernels.fp8_quant.quantize_act_fp8`)."""
    M, K = x.shape
    blocks = x.float().reshape(M, K // FP8_BLOCK, FP8_BLOCK)
    # amax / 448 correctly rounded on every device: CUDA divides by a CPU scalar as a product with
    # its fp32 reciprocal (a different scale for about half the blocks), not by a device tensor
    scale = (blocks.abs().amax(-1) / torch.full((), quant.E4M3_MAX, device=x.device)).clamp_min(1e-12)
    q = (blocks / scale[..., None]).clamp(-quant.E4M3_MAX, quant.E4M3_MAX).to(torch.float8_e4m3fn)
    return q.reshape(M, K), scale


_TRITON_QUANT_OK: dict[torch.device, bool] = {}


def _quantize_act(x: torch.Tensor, outer_major_scales: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 ``x`` ``[M, K]`` with one fp32 scale per 1 × 128 block ``[M, K/128]``: one Triton launch on
    CUDA (:mod:`ember.core.kernels.fp8_quant`, bitwise the PyTorch version), else
    :func:`_quantize_act_torch`. The scales are row-major, or with ``outer_major_scales`` the
    transposed view of a contiguous ``[K/128, M]`` (what ``scaled_mm`` takes)."""
    if x.is_cuda and fp8_quant.available(x) and _TRITON_QUANT_OK.get(x.device, True):
        try:
            return fp8_quant.quantize_act_fp8(x, outer_major_scales)
        except Exception as e:  # noqa: BLE001 - a GPU-only path: fall back to PyTorch
            log.warning("Triton fp8 activation quantisation failed; using PyTorch: %s", e)
            _TRITON_QUANT_OK[x.device] = False
    q, scale = _quantize_act_torch(x)
    return q, (scale.t().contiguous().t() if outer_major_scales else scale)


def _scaled_mm_fp8(x: torch.Tensor, q: torch.Tensor, scale_inv: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``x @ dequant(q, scale_inv).T`` with ``scaled_mm`` (1 × 128 activation blocks, 128 × 128
    weight tiles); checked once per device by :func:`_self_check`."""
    xq, xs = _quantize_act(x, outer_major_scales=True)
    ST = F.ScalingType
    # scale layouts as the blockwise recipes expect them (torch 2.11 on an H200): the activation
    # scales [M, K/128] outer-dim-major (``xs`` already is: the ``.contiguous()`` copies nothing);
    # the weight tiles' as the scales of ``q.t()`` ([K/128, N/128], strides (1, K/128)): the
    # transposed view of the stored [N/128, K/128]
    return F.scaled_mm(xq, q.t(), xs.t().contiguous().t(), ST.BlockWise1x128, scale_inv.t(),
                       ST.BlockWise128x128, output_dtype=out_dtype)


_FP8_GEMM_OK: dict[torch.device, bool] = {}


def _fp8_product(x: torch.Tensor, q: torch.Tensor, scale_inv: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``x @ dequant(q, scale_inv).T`` in W8A8: the Triton kernel up to ``fp8_gemm.SMALL_M`` rows
    (decode), ``scaled_mm`` above (and where the kernel's self-check or a call failed)."""
    if x.shape[0] <= fp8_gemm.SMALL_M and _FP8_GEMM_OK.get(x.device, True) and fp8_gemm.available(x):
        try:
            xq, xs = _quantize_act(x)
            return fp8_gemm.fp8_linear(xq, xs, q, scale_inv, out_dtype)
        except Exception as e:  # noqa: BLE001 - a GPU-only path: fall back to scaled_mm
            _fp8_gemm_failed(x.device, e)
    return _scaled_mm_fp8(x, q, scale_inv, out_dtype)


def _fp8_gemm_failed(device: torch.device, err: Exception | str) -> None:
    if _FP8_GEMM_OK.get(device, True):
        log.warning("Triton fp8 decode product unavailable; using scaled_mm at every row count: %s", err)
    _FP8_GEMM_OK[device] = False


class RolloutLinear:
    """The rollout copy of one :class:`LoraLinear`'s weight (see module doc)."""

    def __init__(self, module: LoraLinear, precision: str, switch: _Switch):
        self.precision = precision
        self.switch = switch
        self.scaled = False  # e4m3 + tile scales multiplied with scaled_mm (fp8 on CUDA sm90)
        self.key = None
        self.refresh(module)

    @property
    def active(self) -> bool:
        return self.switch.depth > 0

    def refresh(self, module: LoraLinear) -> None:
        """(Re)quantise when the module's weight changed since the copy was made."""
        w = module.weight
        if self.key == _key(w):
            return
        if self.key is not None:
            self.switch.version += 1
        self.key = _key(w)
        self.dtype = w.dtype
        N, K = w.shape
        with torch.no_grad():
            if (self.precision == "fp8" and _fp8_capable(w.device) and N % FP8_BLOCK == 0
                    and K % FP8_BLOCK == 0 and _SCALED_MM_OK.get(w.device, True)):
                self.q, self.scale_inv = quant.quantize_fp8_block(w, FP8_BLOCK)
                self.data = None
                self.scaled = True
            else:
                self.data, self.q, self.scale_inv = qdq(w.detach(), self.precision), None, None
                self.scaled = False

    def nbytes(self) -> int:
        if self.scaled:
            return self.q.numel() * self.q.element_size() + self.scale_inv.numel() * 4
        return self.data.numel() * self.data.element_size()

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        if not self.scaled:
            return self.data if self.data.dtype == dtype else self.data.to(dtype)
        return quant.dequant_fp8_block(self.q, self.scale_inv).to(dtype)

    def product(self, module: LoraLinear, x: torch.Tensor, lora: LoraRoute | None, bias: torch.Tensor | None):
        """``module.product`` with the rollout copy as the base weight. A route that multiplies
        ``module``'s shared-input group at once (the static decoder's) takes the product over:
        it calls :func:`group_product`."""
        if lora is not None and lora.packs(module, x):
            return lora.linear(module.lora_name, x, module.weight, bias)
        if self.scaled and x.dim() == 2 and x.shape[0]:
            try:
                y = _fp8_product(x, self.q, self.scale_inv, x.dtype)
            except Exception as e:  # noqa: BLE001 - a GPU-only path: fall back to dequantising
                _scaled_mm_failed(x.device, e)
                self.scaled_failed()
            else:
                if bias is not None:
                    y = y + bias
                return _add_lora(lora, module.lora_name, x, y)
        w = self.dequantized(x.dtype)
        if lora is None:
            return F.linear(x, w, bias)
        return lora.linear(module.lora_name, x, w, bias)

    def scaled_failed(self) -> None:
        """Keep a dequantised copy from now on (the scaled_mm path is off on this device)."""
        if self.scaled:
            self.data = quant.dequant_fp8_block(self.q, self.scale_inv).to(self.dtype)
            self.q = self.scale_inv = None
            self.scaled = False


def group_product(members: list[LoraLinear], x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x`` times the rollout copies of a shared-input group's ``members`` (q/k/v, gate/up: one
    input), laid side by side along ``N`` as the static decoder lays their weights, in one product:
    ``[..., sum of outs]``. Packing makes each copy's tensors views of the group's (the first call
    copies, later ones find them packed); a copy quantised again is packed again on its next use."""
    copies = [m.rollout for m in members]
    if len({c.scaled for c in copies}) != 1:  # one scaled_mm copy turned off by a failure: per member
        y = torch.cat([c.product(m, x, None, None) for m, c in zip(members, copies)], -1)
        return y if bias is None else y + bias
    if copies[0].scaled and x.dim() == 2 and x.shape[0]:
        q, scale_inv = side_by_side([c.q for c in copies]), side_by_side([c.scale_inv for c in copies])
        _views(copies, "q", q)
        _views(copies, "scale_inv", scale_inv)
        try:
            y = _fp8_product(x, q, scale_inv, x.dtype)
        except Exception as e:  # noqa: BLE001 - a GPU-only path: fall back to dequantising
            _scaled_mm_failed(x.device, e)
            for c in copies:
                c.scaled_failed()
        else:
            return y if bias is None else y + bias
    if copies[0].scaled:  # no rows (or not 2-D): the dequantised product
        return F.linear(x, torch.cat([c.dequantized(x.dtype) for c in copies]), bias)
    data = side_by_side([c.data for c in copies])
    _views(copies, "data", data)
    return F.linear(x, data if data.dtype == x.dtype else data.to(x.dtype), bias)


def _views(copies: list[RolloutLinear], attr: str, packed: torch.Tensor) -> None:
    """Point each copy's ``attr`` at its rows of ``packed`` (the copies' tensors side by side)."""
    start = 0
    for c in copies:
        rows = getattr(c, attr).shape[0]
        setattr(c, attr, packed[start : start + rows])
        start += rows


_SCALED_MM_OK: dict[torch.device, bool] = {}


def _scaled_mm_failed(device: torch.device, err: Exception | str) -> None:
    if _SCALED_MM_OK.get(device, True):
        log.warning("fp8 scaled_mm unavailable; dequantising the rollout weights instead: %s", err)
    _SCALED_MM_OK[device] = False


def _add_lora(lora, name: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``y`` plus module ``name``'s LoRA correction on each adapter's tokens (no autograd: sampling):
    a :class:`LoraRoute`'s groups here; the static decoder's route adds its own (``add_delta``)."""
    if lora is None:
        return y
    if not isinstance(lora, LoraRoute):
        return lora.add_delta(name, x, y)
    for g in lora.groups:
        w = g.adapter.weights.get(name) if g.adapter is not None else None
        if w is None or g.size == 0:
            continue
        h = F.linear(x[g.start : g.end], w.A.to(x.dtype))
        y[g.start : g.end].addmm_(h, w.B.to(x.dtype).t(), alpha=g.adapter.scale)
    return y


def _self_check(module: LoraLinear, copy: RolloutLinear) -> None:
    """Compare one product of each fp8 path (scaled_mm, the Triton decode kernel) with the
    dequantised one; turn a path off on a mismatch (a wrong scale layout would otherwise give
    silently wrong rollouts)."""
    x = torch.randn(16, module.weight.shape[1], device=module.weight.device, dtype=module.weight.dtype)
    want = x.float() @ quant.dequant_fp8_block(copy.q, copy.scale_inv).t()
    paths = [(_scaled_mm_fp8, _scaled_mm_failed)]
    if fp8_gemm.available(x) and _FP8_GEMM_OK.get(x.device, True):
        paths.append((lambda x, q, s, dt: fp8_gemm.fp8_linear(*_quantize_act(x), q, s, dt), _fp8_gemm_failed))
    with torch.no_grad():
        for product, failed in paths:
            try:
                got = product(x, copy.q, copy.scale_inv, torch.float32)
            except Exception as e:  # noqa: BLE001
                failed(x.device, e)
                continue
            rel = float((got - want).norm() / want.norm().clamp_min(1e-30))
            if not rel < 0.1:  # activation quantisation alone: ~2-3 % relative error
                failed(x.device, f"self-check relative error {rel:.3g}")


class RolloutExperts:
    """The copies of one :class:`Experts` block's ``gate_up_proj`` / ``down_proj``: under ``fp8``
    on a CUDA device of compute capability 9.x, e4m3 with 128 × 128 tile scales (half the bf16
    bytes), multiplied by :mod:`ember.core.kernels.expert_decode`; otherwise QDQ."""

    def __init__(self, module: Experts, precision: str, switch: _Switch):
        self.precision = precision
        self.switch = switch
        self.key = None
        self.refresh(module)

    @property
    def active(self) -> bool:
        return self.switch.depth > 0

    def refresh(self, module: Experts) -> None:
        key = (_key(module.gate_up_proj), _key(module.down_proj))
        if self.key == key:
            return
        if self.key is not None:
            self.switch.version += 1
        self.key = key
        ws = (module.gate_up_proj.detach(), module.down_proj.detach())
        self.scaled = (self.precision == "fp8" and _fp8_capable(ws[0].device) and expert_decode.available(ws[0])
                       and _EXPERTS_FP8_OK.get(ws[0].device, True)
                       and all(w.shape[-1] % FP8_BLOCK == 0 and w.shape[-2] % FP8_BLOCK == 0 for w in ws))
        with torch.no_grad():
            if self.scaled:
                (self.gate_up_proj, self.gate_up_scale), (self.down_proj, self.down_scale) = (
                    quant.quantize_fp8_block(w, FP8_BLOCK) for w in ws)
            else:
                self.gate_up_proj, self.down_proj = (qdq(w, self.precision) for w in ws)
                self.gate_up_scale = self.down_scale = None

    def weights(self) -> tuple[tuple[torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor | None]]:
        """``((gate_up, its tile scales), (down, its tile scales))``; the scales are None for QDQ copies."""
        return (self.gate_up_proj, self.gate_up_scale), (self.down_proj, self.down_scale)

    def nbytes(self) -> int:
        tensors = (self.gate_up_proj, self.down_proj, self.gate_up_scale, self.down_scale)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


_EXPERTS_FP8_OK: dict[torch.device, bool] = {}


def _experts_check(module: Experts, copy: RolloutExperts) -> None:
    """Compare one expert's product through the fp8 kernel with the dequantised one; on a
    mismatch or a failure, turn the fp8 expert copies off on this device and make ``copy`` QDQ."""
    w, scale = copy.gate_up_proj, copy.gate_up_scale
    x = torch.randn(8, w.shape[-1], device=w.device, dtype=module.gate_up_proj.dtype)
    offsets = torch.full((w.shape[0],), 8, dtype=torch.int32, device=w.device)  # every row to expert 0
    want = x.float() @ quant.dequant_fp8_block(w[0], scale[0]).t()
    err: Exception | str | None = None
    try:
        with torch.no_grad():
            got = expert_decode.expert_linear(x, None, w, offsets, scale).float()
        rel = float((got - want).norm() / want.norm().clamp_min(1e-30))
        if not rel < 0.1:
            err = f"self-check relative error {rel:.3g}"
    except Exception as e:  # noqa: BLE001 - a GPU-only path: fall back to QDQ copies
        err = e
    if err is not None:
        log.warning("fp8 expert kernel unavailable; the experts' rollout copies are dequantised: %s", err)
        _EXPERTS_FP8_OK[w.device] = False
        copy.key = None
        copy.refresh(module)


def targets(model: nn.Module) -> Iterator[LoraLinear | Experts]:
    """The modules that get a rollout copy: base attention/MLP projections and routed experts."""
    for m in model.modules():
        if isinstance(m, Experts) or (isinstance(m, LoraLinear) and m.category in TARGET_CATEGORIES):
            yield m


def attach(model: nn.Module, precision: str) -> int:
    """Give the model's base projections and experts their ``precision`` rollout copies (bf16:
    remove them). Returns the bytes the copies take. Idempotent; a copy whose weight is unchanged
    is kept."""
    check_precision(precision)
    mods = list(targets(model))
    if precision == "bf16":
        for m in mods:
            m.__dict__.pop("rollout", None)
        model.__dict__.pop("_rollout_switch", None)
        return 0
    switch = model.__dict__.get("_rollout_switch")
    if switch is None:
        switch = model.__dict__["_rollout_switch"] = _Switch()
    total, checked, checked_experts = 0, False, False
    for m in mods:
        r = m.__dict__.get("rollout")
        if r is None or r.precision != precision:
            r = (RolloutExperts if isinstance(m, Experts) else RolloutLinear)(m, precision, switch)
            m.rollout = r
        else:
            r.refresh(m)
        if isinstance(r, RolloutLinear) and r.scaled and not checked:
            _self_check(m, r)
            checked = True
        if isinstance(r, RolloutExperts) and r.scaled and not checked_experts:
            _experts_check(m, r)
            checked_experts = True
        if isinstance(r, RolloutLinear) and r.scaled and not _SCALED_MM_OK.get(m.weight.device, True):
            r.scaled_failed()
        total += r.nbytes()
    switch.modules = mods
    log.info("rollout weights attached", extra={"precision": precision, "bytes": total})
    return total


def refresh(model: nn.Module) -> None:
    """Quantise again the copies whose weights changed (full fine-tuning, a load). Runs before
    every sampler step, so it walks the list :func:`attach` kept, not the model's module tree."""
    switch = model.__dict__.get("_rollout_switch")
    for m in switch.modules if switch is not None else ():
        m.rollout.refresh(m)


@contextlib.contextmanager
def sampling(model: nn.Module):
    """Passes inside use the model's rollout copies (no-op without :func:`attach`)."""
    switch = model.__dict__.get("_rollout_switch")
    if switch is None:
        yield
        return
    refresh(model)
    switch.depth += 1
    try:
        yield
    finally:
        switch.depth -= 1
