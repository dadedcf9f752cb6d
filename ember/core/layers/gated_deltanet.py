"""Gated DeltaNet linear attention (Yang et al., arXiv:2412.06464) over packed sequences, as in
Qwen3-Next and Qwen3.8-Flash-Next (spec §3.4; transformers ``Qwen3NextGatedDeltaNet``).

Per value head a state ``S`` (``[dk, dv]``, fp32) evolves token by token::

    S ← exp(g_t)·S;   S ← S + k_t (β_t (v_t − Sᵀk_t))ᵀ;   o_t = Sᵀ q_t

with ``q, k`` L2-normalised (``q`` also scaled by ``dk^-1/2``), ``β = σ(b)`` and
``g = −exp(A_log)·softplus(a + dt_bias)``. Training and prefill use the chunked (UT/WY) form over
chunks of 64 tokens, one row per sequence so that no state crosses ``ctx.seq_lens``; a decoding pass
of one token per sequence uses the recurrent form. Between passes the layer keeps, through
``ctx.state``: ``conv`` (``[N, K-1, C]``, the last inputs of its short convolution, channels in
:meth:`GatedDeltaNet._project`'s order) and ``recurrent`` (``[N, Hv, dk, dv]``, fp32).

Two implementations of the rule (:func:`gdn_backend`): ``torch`` — the functions below, in fp32
(the CPU path and the reference); ``fla`` — flash-linear-attention's Triton kernels
(``fla-core``, an optional GPU dependency: ``chunk_gated_delta_rule`` over ``cu_seqlens`` for
training and prefill, ``fused_recurrent_gated_delta_rule`` for decoding), used on CUDA for
bf16 and fp16 models when it is installed. fla takes the bf16 q/k/v with q and k at the value
heads: :func:`~ember.core.kernels.l2norm_heads.l2norm_repeat` normalises each key head once and
writes its copies (fla 0.4.2 has no grouped value heads), and fla keeps the state in fp32. With
the fla backend, a pass without carried state (training, scoring) takes the short convolution and
its SiLU through :mod:`ember.core.kernels.causal_conv`. ``bench/gpu_checks.py gdn`` compares it
with the torch path. fla-core 0.4.2 is the version to
install: from 0.5 on, fla refuses the gated backward on Hopper with Triton 3.4 to 3.7.0 (fla
issue 640: a Triton codegen bug at a 64-wide key tile), which torch 2.11's Triton 3.6 is;
0.4.2 tiles keys 128 wide on Hopper, which avoids it, and the GPU check holds its gradients to
the fp64 rule.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from ember.core.batch import to_device
from ember.core.kernels.causal_conv import positions, silu_causal_conv
from ember.core.kernels.l2norm_heads import l2norm, l2norm_repeat
from ember.core.layers.copies import contiguous
from ember.core.layers.lora import LoraLinear, LoraRoute
from ember.core.layers.norms import RMSNorm, gated_rms_norm
from ember.core.layers.packed_conv import causal_conv

if TYPE_CHECKING:
    from ember.core.models.base import ForwardContext

CHUNK = 64
BACKENDS = ("torch", "fla")
_ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "sigmoid": torch.sigmoid}


@dataclass(frozen=True)
class GDNShape:
    """Head counts and sizes of a Gated DeltaNet layer (transformers ``linear_*`` config fields)."""

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    eps: float
    gate_activation: str  # of the output gate: silu (Qwen3-Next) or sigmoid (Qwen3.8-Flash-Next)

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> GDNShape:
        act = raw.get("output_gate_type") or raw.get("hidden_act", "silu")
        if act not in _ACTIVATIONS:
            raise ValueError(f"output_gate_type {act!r} is not supported; supported: {sorted(_ACTIVATIONS)}")
        shape = cls(
            num_k_heads=int(raw.get("linear_num_key_heads", 16)),
            num_v_heads=int(raw.get("linear_num_value_heads", 32)),
            head_k_dim=int(raw.get("linear_key_head_dim", 128)),
            head_v_dim=int(raw.get("linear_value_head_dim", 128)),
            conv_kernel=int(raw.get("linear_conv_kernel_dim", 4)),
            eps=float(raw.get("rms_norm_eps", 1e-6)),
            gate_activation=act,
        )
        if shape.num_v_heads % shape.num_k_heads:
            raise ValueError(
                f"linear_num_value_heads ({shape.num_v_heads}) must be a multiple of "
                f"linear_num_key_heads ({shape.num_k_heads})"
            )
        return shape

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    seq_lens: list[int],
    initial_state: torch.Tensor | None = None,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked gated delta rule for packed sequences (fp32).

    ``q, k`` ``[T, H, dk]`` (normalised and scaled), ``v`` ``[T, H, dv]``, ``g, beta`` ``[T, H]``;
    ``initial_state`` ``[N, H, dk, dv]`` or ``None``. Returns ``o`` ``[T, H, dv]`` and the final
    state ``[N, H, dk, dv]``. Each sequence is one row padded to whole chunks; padding has
    ``k = v = β = g = 0`` so it changes neither outputs nor the final state. The math follows
    transformers' ``torch_chunk_gated_delta_rule`` (UT transform by a unit-triangular solve).
    """
    n, device = len(seq_lens), q.device
    H, dk, dv = k.shape[1], k.shape[2], v.shape[2]
    length = math.ceil(max(seq_lens) / chunk) * chunk
    lens = torch.tensor(seq_lens, device=device)
    row = torch.repeat_interleave(torch.arange(n, device=device), lens)
    col = torch.arange(q.shape[0], device=device) - torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)

    def rows(x: torch.Tensor) -> torch.Tensor:  # [T, H, ...] -> [N, H, chunks, chunk, ...]
        out = x.new_zeros(n, length, *x.shape[1:]).index_put((row, col), x)
        out = out.transpose(1, 2)
        return out.reshape(n, H, length // chunk, chunk, *x.shape[2:])

    q, k, v, g, beta = rows(q), rows(k), rows(v), rows(g), rows(beta)
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=device).triu(1)
    gc = g.cumsum(-1)
    decay = (gc[..., :, None] - gc[..., None, :]).masked_fill(upper, float("-inf")).exp()
    system = (k_beta @ k.transpose(-1, -2)) * decay
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(system, k_beta * gc.exp()[..., None], upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * decay
    q = q * gc.exp()[..., None]
    k = k * (gc[..., -1:] - gc).exp()[..., None]
    chunk_decay = gc[..., -1].exp()[..., None, None]
    state = q.new_zeros(n, H, dk, dv) if initial_state is None else initial_state.to(q.dtype)
    outs = []
    for i in range(length // chunk):
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ state
        outs.append(q[:, :, i] @ state + intra[:, :, i] @ v_new)
        state = state * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    o = torch.stack(outs, 2).reshape(n, H, length, dv).transpose(1, 2)
    return o[row, col], state


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of the gated delta rule for one token per sequence (fp32): ``q, k`` ``[N, H, dk]``,
    ``v`` ``[N, H, dv]``, ``g, beta`` ``[N, H]``, ``state`` ``[N, H, dk, dv]`` (``None``: zero).
    Returns ``o`` ``[N, H, dv]`` and the new state."""
    if state is None:
        state = q.new_zeros(*k.shape, v.shape[-1])
    state = state.to(q.dtype) * g.exp()[..., None, None]
    delta = (v - (state * k[..., None]).sum(-2)) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return (state * q[..., None]).sum(-2), state


@cache
def _fla_ops():
    """fla's ``(chunk_gated_delta_rule, fused_recurrent_gated_delta_rule)``, or ``None`` where
    ``fla-core`` (or Triton) is not installed."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as chunk
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as recurrent
    except ImportError:
        return None
    return chunk, recurrent


def _cu_seqlens(seq_lens: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``cu_seqlens`` of packed sequences on ``device`` and its host copy (fla reads the host
    copy for its chunk indices, so a pass needs no device-to-host sync)."""
    cu_cpu = torch.tensor([0, *seq_lens], dtype=torch.long).cumsum(0)
    return to_device(cu_cpu, device), cu_cpu


def gdn_backend(x: torch.Tensor, requested: str | None = None) -> str:
    """The implementation of the rule for activations ``x``: ``requested`` if given (``fla``
    needs CUDA and ``fla-core``), else ``fla`` for bf16/fp16 CUDA tensors when it is installed and
    ``torch`` otherwise."""
    if requested is not None:
        if requested not in BACKENDS:
            raise ValueError(f"GDN backend must be one of {BACKENDS}, not {requested!r}")
        if requested == "fla" and (not x.is_cuda or _fla_ops() is None):
            raise RuntimeError("the fla GDN backend needs a CUDA device and fla-core (pip install fla-core)")
        return requested
    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and _fla_ops() is not None:
        return "fla"
    return "torch"


def fla_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    seq_lens: list[int],
    initial_state: torch.Tensor | None,
    output_final_state: bool,
    cu_seqlens: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The rule through fla's kernels, for packed sequences: ``q, k`` ``[T, Hk, dk]`` (not yet
    normalised; value head ``j`` reads key head ``j // (H / Hk)``), ``v`` ``[T, H, dv]``, ``g, beta``
    ``[T, H]``, ``initial_state`` ``[N, H, dk, dv]`` fp32 or ``None``. One token per sequence with a
    state takes the recurrent kernel. Returns ``o`` ``[T, H, dv]`` (``v``'s dtype) and the final
    fp32 state (``None`` unless ``output_final_state``). ``cu_seqlens``: :func:`_cu_seqlens` of
    ``seq_lens``, if the caller has it."""
    chunk, recurrent = _fla_ops()
    scale = q.shape[-1] ** -0.5
    r = v.shape[1] // q.shape[1]
    q, k = l2norm_repeat(q, r), l2norm_repeat(k, r)  # normalised here, not by fla (use_qk_l2norm_in_kernel)
    if initial_state is not None and max(seq_lens) == 1:
        # by keyword: fla's recurrent kernel also takes per-key and per-value decays (gk, gv)
        # between g and beta
        o, final = recurrent(
            q[:, None], k[:, None], v[:, None], g=g[:, None], beta=beta[:, None], scale=scale,
            initial_state=initial_state, output_final_state=output_final_state, use_qk_l2norm_in_kernel=False,
        )
        return o[:, 0], final
    cu, cu_cpu = cu_seqlens or _cu_seqlens(seq_lens, q.device)
    o, final = chunk(
        q[None], k[None], v[None], g=g[None], beta=beta[None], scale=scale,
        initial_state=initial_state, output_final_state=output_final_state, use_qk_l2norm_in_kernel=False,
        cu_seqlens=cu, cu_seqlens_cpu=cu_cpu,
    )
    return o[0], final


class GatedRMSNorm(RMSNorm):
    """``w ⊙ RMSNorm(x) ⊙ act(z)`` per head (transformers ``RMSNormGated``: normalise in fp32, cast,
    scale by ``w`` (initialised to 1), then gate in fp32): :func:`~ember.core.layers.norms.gated_rms_norm`."""

    def __init__(self, dim: int, eps: float, activation: str):
        super().__init__(dim, eps)
        if activation not in _ACTIVATIONS:
            raise ValueError(f"gate activation {activation!r} is not supported; supported: {sorted(_ACTIVATIONS)}")
        self.sigmoid = activation == "sigmoid"

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return gated_rms_norm(x, gate, self.weight, self.eps, self.sigmoid)


class GatedDeltaNet(nn.Module):
    """The linear-attention token mixer of Qwen3-Next (``fused_projections``: ``in_proj_qkvz`` and
    ``in_proj_ba``, interleaved per key head) and Qwen3.8-Flash-Next (``in_proj_qkv``, ``in_proj_z``,
    ``in_proj_b``, ``in_proj_a``). Projections are LoRA targets (``attn``); the short convolution,
    ``A_log``, ``dt_bias`` and the norm stay frozen (spec §3.9). ``backend``: the rule's
    implementation (``None``: :func:`gdn_backend`'s choice)."""

    backend: str | None = None

    def __init__(self, hidden: int, shape: GDNShape, layer: int, fused_projections: bool):
        super().__init__()
        self.layer = layer
        self.shape = shape
        self.fused_projections = fused_projections
        s = shape
        conv_dim = 2 * s.key_dim + s.value_dim
        if fused_projections:
            self.in_proj_qkvz = LoraLinear(hidden, 2 * s.key_dim + 2 * s.value_dim, False, "attn")
            self.in_proj_ba = LoraLinear(hidden, 2 * s.num_v_heads, False, "attn")
        else:
            self.in_proj_qkv = LoraLinear(hidden, conv_dim, False, "attn")
            self.in_proj_z = LoraLinear(hidden, s.value_dim, False, "attn")
            self.in_proj_b = LoraLinear(hidden, s.num_v_heads, False, "attn")
            self.in_proj_a = LoraLinear(hidden, s.num_v_heads, False, "attn")
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, s.conv_kernel, groups=conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(s.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(s.num_v_heads))
        self.norm = GatedRMSNorm(s.head_v_dim, s.eps, s.gate_activation)
        self.out_proj = LoraLinear(s.value_dim, hidden, False, "attn")

    def _project(self, x: torch.Tensor, lora: LoraRoute | None) -> tuple[torch.Tensor, ...]:
        """``(qkv [T, 2·Kd + Vd], z [T, Hv, dv], b [T, Hv], a [T, Hv])``; ``qkv``'s channels in
        :meth:`_split_qkv`'s order."""
        s, T = self.shape, x.shape[0]
        if not self.fused_projections:
            z = self.in_proj_z(x, lora).view(T, s.num_v_heads, s.head_v_dim)
            return self.in_proj_qkv(x, lora), z, self.in_proj_b(x, lora), self.in_proj_a(x, lora)
        r = s.num_v_heads // s.num_k_heads
        qkvz = self.in_proj_qkvz(x, lora).view(T, s.num_k_heads, -1)
        qkv, z = qkvz.split([2 * s.head_k_dim + r * s.head_v_dim, r * s.head_v_dim], dim=-1)
        b, a = self.in_proj_ba(x, lora).view(T, s.num_k_heads, 2 * r).split([r, r], dim=-1)
        # one copy of the key heads' [q | k | v] columns, kept in that order: the short convolution
        # is per channel, so its weights are put in the same order (_conv_weight) rather than the
        # activations in the checkpoint's [q of all heads | k | v] order (three copies and a cat)
        qkv, z = contiguous(qkv).view(T, -1), contiguous(z).view(T, s.num_v_heads, s.head_v_dim)
        return qkv, z, b.reshape(T, -1), a.reshape(T, -1)

    def _conv_weight(self) -> torch.Tensor:
        """The short convolution's ``[C, K]`` taps in the order of :meth:`_project`'s channels."""
        w = self.conv1d.weight[:, 0]
        if not self.fused_projections:
            return w
        s = self.shape
        r = s.num_v_heads // s.num_k_heads
        q, k, v = w.split([s.key_dim, s.key_dim, s.value_dim])
        heads = [q.view(s.num_k_heads, s.head_k_dim, -1), k.view(s.num_k_heads, s.head_k_dim, -1),
                 v.view(s.num_k_heads, r * s.head_v_dim, -1)]
        return torch.cat(heads, dim=1).view(w.shape)

    def _split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``q, k`` ``[T, Hk, dk]`` and ``v`` ``[T, Hv, dv]`` of the convolved channels: ``[q | k |
        v]`` over all heads (``in_proj_qkv``), or per key head (``in_proj_qkvz``)."""
        s, T = self.shape, qkv.shape[0]
        if self.fused_projections:
            r = s.num_v_heads // s.num_k_heads
            q, k, v = qkv.view(T, s.num_k_heads, -1).split([s.head_k_dim, s.head_k_dim, r * s.head_v_dim], dim=-1)
        else:
            q, k, v = qkv.split([s.key_dim, s.key_dim, s.value_dim], dim=-1)
        v = contiguous(v).view(T, s.num_v_heads, s.head_v_dim)  # fla would copy a strided v at PyTorch's speed
        return q.reshape(T, s.num_k_heads, s.head_k_dim), k.reshape(T, s.num_k_heads, s.head_k_dim), v

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        s, T = self.shape, x.shape[0]
        seq_lens = ctx.seq_lens or [T]
        state = ctx.state
        qkv, z, b, a = self._project(x, ctx.lora)
        backend = gdn_backend(x, self.backend)
        if backend == "fla" and state is None:  # a pass without carried state: one kernel each way
            pos = ctx.memo(("seq_positions", x.device), lambda: to_device(positions(seq_lens), x.device))
            qkv = silu_causal_conv(qkv, self._conv_weight(), pos)
        else:
            conv_history = state.get(self.layer, "conv") if state is not None else None
            qkv, conv_history = causal_conv(qkv, self._conv_weight(), seq_lens, conv_history)
            qkv = F.silu(qkv).to(x.dtype)
        q, k, v = self._split_qkv(qkv)
        recurrent = state.get(self.layer, "recurrent") if state is not None else None
        f = torch.promote_types(x.dtype, torch.float32)  # gates in fp32 (fp64 for fp64 models)
        g = -self.A_log.to(f).exp() * F.softplus(a.to(f) + self.dt_bias)
        if backend == "fla":
            cu = ctx.memo(("cu_seqlens", x.device), lambda: _cu_seqlens(seq_lens, x.device))
            o, recurrent = fla_gated_delta_rule(q, k, v, g, b.sigmoid(), seq_lens, recurrent, state is not None, cu)
        else:
            r = s.num_v_heads // s.num_k_heads  # value head j reads key head j // r
            q, k = q.repeat_interleave(r, dim=1), k.repeat_interleave(r, dim=1)
            q, k = l2norm(q.to(f)) * s.head_k_dim**-0.5, l2norm(k.to(f))
            v, beta = v.to(f), b.sigmoid().to(f)
            if state is not None and max(seq_lens) == 1:
                o, recurrent = recurrent_gated_delta_rule(q, k, v, g, beta, recurrent)
            else:
                o, recurrent = chunk_gated_delta_rule(q, k, v, g, beta, seq_lens, recurrent)
        if state is not None:
            state.put(self.layer, "conv", conv_history)
            state.put(self.layer, "recurrent", recurrent)
        o = self.norm(o.to(x.dtype), z)
        return self.out_proj(o.reshape(T, -1), ctx.lora)

