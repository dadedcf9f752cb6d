"""Tensor parallelism (Megatron's column/row split) for the attention and MLP projections.

A column-parallel linear keeps rows ``[start, end)`` of its weight (whole attention heads, a slice
of the MLP width); its input is the same on every rank of the TP group, and its backward sums the
input gradient over the group. A row-parallel linear keeps the matching columns; each rank's
product is a partial sum, added up by an all-reduce (its bias once, after it).

LoRA factors split to match: ``B`` of a column-parallel linear and ``A`` of a row-parallel one are
sharded; the other factor is replicated. The row-parallel LoRA term folds into the partial sums
(``Σ_r (x_r A_rᵀ) Bᵀ = (x Aᵀ) Bᵀ``), so it needs no collective of its own.

Which gradients are complete where (summed by :mod:`ember.dist.adapters`):

* sharded factors (column ``B``, row ``A``): complete on their rank, summed over the ranks that ran
  other sequences (``dp_group``);
* the replicated factor of a split linear (column ``A``, row ``B``): each rank holds the part its
  shard contributed, summed over every rank;
* factors of linears that are not split: computed whole on every rank of a TP group, summed over
  ``dp_group`` only.

The LM head is split by vocabulary (:class:`VocabParallel`): each rank holds ``V / tp`` rows of it
(a view of the tied embedding's rows when the two are tied) and of its LoRA ``B``; the chunked
logprob pass combines the ranks' log-sum-exps per chunk and never builds a row of logits over the
whole vocabulary (:mod:`ember.core.logprobs`); a sampler gathers the few rows it draws from. Its
LoRA ``A`` gets its whole gradient on every rank (the pass sums ``d(hA)`` over the group).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from ember.core.layers.gated_deltanet import GatedDeltaNet
from ember.core.layers.lora import LoraLinear
from ember.core.layers.mla import MultiHeadLatentAttention
from ember.core.layers.short_conv import DynamicShortConvolution
from ember.core.models.inkling2 import Inkling2Attention
from ember.dist import comm
from ember.dist.mesh import Parallel


class _CopyToGroup(torch.autograd.Function):
    """Forward: identity. Backward: the gradient summed over the group."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        return comm.all_reduce_sum_(g.contiguous().clone(), ctx.group), None


class _ReduceFromGroup(torch.autograd.Function):
    """Forward: the partial sums added over the group. Backward: identity."""

    @staticmethod
    def forward(ctx, y, group):
        return comm.all_reduce_sum_(y.contiguous().clone(), group)

    @staticmethod
    def backward(ctx, g):
        return g, None


def copy_to_group(x: torch.Tensor, group) -> torch.Tensor:
    """``x`` as it is, with its gradient summed over ``group`` in backward (an input that every
    rank of the group holds and each uses for its own part of the work)."""
    return _CopyToGroup.apply(x, group)


class _Split:
    """A split projection's collectives (the ``shard`` of a :class:`LoraLinear`). ``sp``: the
    model's :class:`~ember.dist.sequence_parallel.SequenceParallel` once it is applied; while it
    is active the module's input rows were gathered (their gradient is reduce-scattered there)."""

    sp = None

    def __init__(self, group):
        self.group = group

    def sequence_parallel(self) -> bool:
        return self.sp is not None and self.sp.active


class ColumnParallel(_Split):
    """``copy_input=False``: the input's gradient is summed where the input is made (a replicated
    projection whose output is copied, MLA's latents), not here."""

    def __init__(self, group, copy_input: bool = True):
        super().__init__(group)
        self.copy_input = copy_input

    def __call__(self, mod: LoraLinear, x: torch.Tensor, lora) -> torch.Tensor:
        if self.copy_input and not self.sequence_parallel():
            x = copy_to_group(x, self.group)
        return mod.product(x, lora, mod.bias)


class CopiedOutput(_Split):
    """A projection computed whole on every rank whose output each rank uses for its own heads:
    the output's gradient is summed over the group (MLA's query and key/value latents, whose
    rotary key every head reads). Under sequence parallelism the sum is left to the gather of
    the module's input, and the factors' gradients are parts (``PARTIAL``)."""

    def __call__(self, mod: LoraLinear, x: torch.Tensor, lora) -> torch.Tensor:
        y = mod.product(x, lora, mod.bias)
        return y if self.sequence_parallel() else copy_to_group(y, self.group)


class RowParallel(_Split):
    """The partial sums all-reduced, or under sequence parallelism reduce-scattered to each
    rank's rows."""

    def __call__(self, mod: LoraLinear, x: torch.Tensor, lora) -> torch.Tensor:
        y = mod.product(x, lora, None)
        y = self.sp.scatter(y) if self.sequence_parallel() else _ReduceFromGroup.apply(y, self.group)
        return y if mod.bias is None else y + mod.bias


class VocabParallel:
    """This rank's rows ``start..stop`` of a vocabulary of ``size`` (a
    :class:`~ember.core.logprobs.VocabSplit`), over the TP group."""

    def __init__(self, group, start: int, stop: int, size: int):
        self.group, self.start, self.stop, self.size = group, start, stop, size

    def local(self, weight: torch.Tensor) -> torch.Tensor:
        return weight if weight.shape[0] == self.stop - self.start else weight[self.start : self.stop]

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return comm.all_gather(x[None], self.group)

    def sum_(self, x: torch.Tensor) -> torch.Tensor:
        return comm.all_reduce_sum_(x, self.group)


def _split_vocab(model: nn.Module, parallel: Parallel, blocks: dict, kinds: dict) -> None:
    """The LM head by vocabulary rows: its own rows when untied; tied, the embedding stays whole
    (every rank looks up every token) and the head reads this rank's rows of it. A head stored
    with padding rows past the vocabulary (Inkling2's ``PaddedLMHead``) splits its token rows and
    drops the padding, so no padded logit ever exists; TP must then divide the vocabulary itself."""
    head, vocab = model.lm_head, model.config.vocab_size
    if vocab % parallel.layout.tp:
        raise ValueError(f"--tp {parallel.layout.tp} must divide the vocabulary ({vocab})")
    start, stop = parallel.layout.tp_range(vocab)
    if model.config.tie_word_embeddings:
        head.out_features = stop - start
    elif head.weight.shape[0] != vocab:
        # a head stored with padding rows beyond the tokens (Inkling2's PaddedLMHead): the token
        # rows are split, the padding is never read
        head.weight = _narrowed(head.weight, [(start, stop - start)])
        head.out_features = stop - start
        blocks["lm_head.weight"] = (0, start, stop - start)
    else:
        _split(head, "lm_head", parallel, 0, blocks)
    model.vocab_split = VocabParallel(parallel.tp_group, start, stop, vocab)
    kinds["lm_head.lora_B"] = SHARDED_ROWS


# factor kinds (how a factor's gradient is reduced and how a checkpoint gathers it)
REPLICATED, PARTIAL, SHARDED_ROWS, SHARDED_COLS = "replicated", "partial", "rows", "cols"


def _split(mod: LoraLinear, name: str, parallel: Parallel, dim: int, blocks: dict) -> None:
    full = mod.weight.shape[dim]
    if full % parallel.layout.tp:
        raise ValueError(f"--tp {parallel.layout.tp} must divide {name}'s {('output', 'input')[dim]} width ({full})")
    start, end = parallel.layout.tp_range(full)
    w = mod.weight.data.narrow(dim, start, end - start).clone()
    mod.weight = nn.Parameter(w, requires_grad=False)
    blocks[f"{name}.weight"] = (dim, start, end - start)
    if dim == 0:
        mod.out_features = end - start
        if mod.bias is not None:
            mod.bias = nn.Parameter(mod.bias.data[start:end].clone(), requires_grad=False)
            blocks[f"{name}.bias"] = (0, start, end - start)
    else:
        mod.in_features, mod.in_start, mod.full_in_features = end - start, start, full


class _ShardedRMSNormFn(torch.autograd.Function):
    """Olmo 3's RMSNorm (weight applied in fp32 before the cast) over a width split across the
    group: the mean of squares and the backward's row dot product are summed over the group."""

    @staticmethod
    def forward(ctx, x, weight, eps: float, width: int, group):
        xf = x.float()
        sq = comm.all_reduce_sum_(xf.pow(2).sum(-1, keepdim=True), group)
        rstd = torch.rsqrt(sq / width + eps)
        ctx.save_for_backward(x, weight, rstd)
        ctx.width, ctx.group = width, group
        return (weight.float() * (xf * rstd)).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        xhat = x.float() * rstd
        dxhat = dy.float() * weight.float()
        dot = comm.all_reduce_sum_((dxhat * xhat).sum(-1, keepdim=True), ctx.group)
        dx = rstd * (dxhat - xhat * dot / ctx.width)
        return dx.to(x.dtype), None, None, None, None


class ShardedRMSNorm(nn.Module):
    """An RMSNorm over a split width (Olmo 3's q/k norms over the whole q and k projections, under
    TP): this rank's slice of the weight (frozen)."""

    def __init__(self, norm: nn.Module, start: int, end: int, group):
        super().__init__()
        self.weight = nn.Parameter(norm.weight.data[start:end].clone(), requires_grad=False)
        self.eps, self.width, self.group = norm.eps, norm.weight.shape[0], group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ShardedRMSNormFn.apply(x, self.weight, self.eps, self.width, self.group)


def _narrowed(p: torch.Tensor, pieces: list[tuple[int, int]]) -> nn.Parameter:
    return nn.Parameter(torch.cat([p.data.narrow(0, s, n) for s, n in pieces]).clone(), requires_grad=False)


def _split_rows(mod: LoraLinear, name: str, pieces: list[tuple[int, int]], blocks: dict) -> None:
    """Keep rows ``pieces`` (``(start, length)``, in order) of a column-parallel linear."""
    mod.weight = _narrowed(mod.weight, pieces)
    mod.out_features = sum(n for _, n in pieces)
    blocks[f"{name}.weight"] = (0, pieces)


def _shard_gated_deltanet(mod, name, parallel, blocks, kinds, pieces, column, row) -> None:
    """Gated DeltaNet by key heads (with their value heads). Qwen3-Next's fused ``in_proj_qkvz`` and
    ``in_proj_ba`` hold their rows per key head, so a contiguous block of rows is a block of heads;
    Qwen3.8-Flash-Next's ``in_proj_qkv`` ([q | k | v] over all heads) is three pieces, as is the
    short convolution's channels; ``in_proj_z/b/a``, ``A_log`` and ``dt_bias`` are per value head;
    ``out_proj`` is row-parallel."""
    s, tp = mod.shape, parallel.layout.tp
    for what, n in (("key heads", s.num_k_heads), ("value heads", s.num_v_heads)):
        if n % tp:
            raise ValueError(f"--tp {tp} must divide {name}'s {what} ({n})")
    k0, k1 = parallel.layout.tp_range(s.num_k_heads)
    v0, v1 = parallel.layout.tp_range(s.num_v_heads)
    dk, dv = s.head_k_dim, s.head_v_dim
    qkv = [(k0 * dk, (k1 - k0) * dk), (s.key_dim + k0 * dk, (k1 - k0) * dk), (2 * s.key_dim + v0 * dv, (v1 - v0) * dv)]
    if mod.fused_projections:
        contiguous = ("in_proj_qkvz", "in_proj_ba")
    else:
        contiguous = ("in_proj_z", "in_proj_b", "in_proj_a")
        _split_rows(mod.in_proj_qkv, f"{name}.in_proj_qkv", qkv, blocks)
        mod.in_proj_qkv.shard = column
        kinds[f"{name}.in_proj_qkv.lora_A"], kinds[f"{name}.in_proj_qkv.lora_B"] = PARTIAL, SHARDED_ROWS
        pieces[f"{name}.in_proj_qkv.lora_B"] = [n for _, n in qkv]
    for leaf in contiguous:
        lin = getattr(mod, leaf)
        _split(lin, f"{name}.{leaf}", parallel, 0, blocks)
        lin.shard = column
        kinds[f"{name}.{leaf}.lora_A"], kinds[f"{name}.{leaf}.lora_B"] = PARTIAL, SHARDED_ROWS
    _split(mod.out_proj, f"{name}.out_proj", parallel, 1, blocks)
    mod.out_proj.shard = row
    kinds[f"{name}.out_proj.lora_A"], kinds[f"{name}.out_proj.lora_B"] = SHARDED_COLS, PARTIAL
    mod.conv1d.weight = _narrowed(mod.conv1d.weight, qkv)
    blocks[f"{name}.conv1d.weight"] = (0, qkv)
    for p in ("A_log", "dt_bias"):
        setattr(mod, p, _narrowed(getattr(mod, p), [(v0, v1 - v0)]))
        blocks[f"{name}.{p}"] = (0, v0, v1 - v0)
    mod.shape = replace(s, num_k_heads=k1 - k0, num_v_heads=v1 - v0)


def _narrow_param(mod: nn.Module, pname: str, name: str, dim: int, start: int, n: int, blocks: dict) -> None:
    """Narrow the frozen parameter ``pname`` of ``mod`` (named ``name``) to ``[start, start + n)``
    along ``dim``."""
    p = getattr(mod, pname)
    setattr(mod, pname, nn.Parameter(p.data.narrow(dim, start, n).clone(), requires_grad=False))
    blocks[f"{name}.{pname}"] = (dim, start, n)


def _shard_inkling2_attention(mod: Inkling2Attention, name, parallel, blocks, kinds, column, row) -> None:
    """Inkling2's relative attention by heads (global and sliding-window layers have their own head
    and KV-head counts and head dims): ``q``/``gate`` by query heads and ``k``/``v`` by KV heads
    (column-parallel), ``o`` row-parallel; narrowed with them, all frozen: the relative-state
    projection ``r_proj`` (``d_rel`` rows per head), the sink projection (one row per head), the
    L2-clip scales (``[heads, ·]``), the K/V short convolutions' channels and, on global layers,
    their per-KV-head tap projections and static taps. The profile bank (``[d_rel, R]``) is shared
    by the heads and stays whole.

    The frozen projections' input gradients need no collective of their own: training passes run
    under sequence parallelism, where the gather of the attention's inputs (``x``, ``k_in``,
    ``v_in``) sums every rank's part of their gradients in its reduce-scatter; plain TP serves
    sampling, without gradients."""
    tp = parallel.layout.tp
    layer = "global" if mod.is_global else "sliding-window"
    for what, n in (("attention heads", mod.heads), ("key/value heads", mod.kv_heads)):
        if n % tp:
            raise ValueError(f"--tp {tp} must divide the {n} {what} of {name} (a {layer} layer)")
    h0, h1 = parallel.layout.tp_range(mod.heads)
    k0, k1 = parallel.layout.tp_range(mod.kv_heads)
    nh, nk, d = h1 - h0, k1 - k0, mod.head_dim
    for leaf in ("q_proj", "k_proj", "v_proj", "gate_proj"):
        _split(getattr(mod, leaf), f"{name}.{leaf}", parallel, 0, blocks)
        getattr(mod, leaf).shard = column
        kinds[f"{name}.{leaf}.lora_A"], kinds[f"{name}.{leaf}.lora_B"] = PARTIAL, SHARDED_ROWS
    _split(mod.o_proj, f"{name}.o_proj", parallel, 1, blocks)
    mod.o_proj.shard = row
    kinds[f"{name}.o_proj.lora_A"], kinds[f"{name}.o_proj.lora_B"] = SHARDED_COLS, PARTIAL
    d_rel = mod.r_proj.out_features // mod.heads
    for leaf, per_head in (("r_proj", d_rel), ("sink_proj", 1)):
        lin = getattr(mod, leaf)
        _narrow_param(lin, "weight", f"{name}.{leaf}", 0, h0 * per_head, nh * per_head, blocks)
        lin.out_features = nh * per_head
    for leaf in ("q_l2_clip", "rel_l2_clip"):  # scale [heads, ·]
        _narrow_param(getattr(mod, leaf), "scale", f"{name}.{leaf}", 0, h0, nh, blocks)
    for leaf in ("k_sconv", "v_sconv"):
        conv, where = getattr(mod, leaf), f"{name}.{leaf}"
        if isinstance(conv, DynamicShortConvolution):  # static taps [K, channels], tap projection [heads · K, H]
            _narrow_param(conv, "static_weight", where, 1, k0 * d, nk * d, blocks)
            K = conv.kernel
            _narrow_param(conv.weight_proj, "weight", f"{where}.weight_proj", 0, k0 * K, nk * K, blocks)
            conv.weight_proj.out_features, conv.num_heads = nk * K, nk
        else:  # [channels, 1, K]
            _narrow_param(conv.conv1d, "weight", f"{where}.conv1d", 0, k0 * d, nk * d, blocks)
    mod.heads, mod.kv_heads = nh, nk


def shard_linears(model: nn.Module, parallel: Parallel) -> tuple[dict[str, str], dict[str, list[int]]]:
    """Split the attention and dense-MLP projections (q/k/v and gate/up column-parallel, o and
    down row-parallel; Olmo 3's whole-width q/k norms with them; MLA's ``q_b``/``kv_b`` by heads
    behind latents computed whole; Gated DeltaNet by key heads; Inkling2's relative attention by
    heads) and the LM head by vocabulary, in place. Returns the kind of
    every LoRA factor (``{module}.lora_A`` / ``.lora_B``) of a split module, and for a factor whose
    rows are several pieces of the whole (``[q | k | v]``), this rank's length of each piece."""
    tp = parallel.layout.tp
    cfg = model.config
    for what, n in (("attention heads", cfg.num_heads), ("key/value heads", cfg.num_kv_heads),
                    ("MLP width (intermediate_size)", cfg.intermediate_size)):
        if n % tp:
            raise ValueError(f"--tp {tp} must divide the model's {what} ({n})")
    mla = any(isinstance(m, MultiHeadLatentAttention) for m in model.modules())
    latent_column = ColumnParallel(parallel.tp_group, copy_input=False)
    copied = CopiedOutput(parallel.tp_group)
    kinds, pieces = {}, {}
    blocks = model.__dict__.setdefault("param_blocks", {})  # read by load_model: what to read of each tensor
    column, row = ColumnParallel(parallel.tp_group), RowParallel(parallel.tp_group)
    done: set[str] = set()  # modules split with their parent
    for name, mod in list(model.named_modules()):
        leaf = name.rsplit(".", 1)[-1]
        if name.rsplit(".", 1)[0] in done:
            done.add(name)
        elif isinstance(mod, Inkling2Attention):
            _shard_inkling2_attention(mod, name, parallel, blocks, kinds, column, row)
            done.add(name)
        elif isinstance(mod, MultiHeadLatentAttention):
            mod.cfg = replace(mod.cfg, num_heads=mod.cfg.num_heads // tp)  # this rank's heads
        elif isinstance(mod, LoraLinear) and mla and leaf in ("q_a_proj", "kv_a_proj_with_mqa"):
            mod.shard = copied  # whole on every rank; kind: replicated
        elif isinstance(mod, LoraLinear) and mla and leaf in ("q_b_proj", "kv_b_proj"):
            _split(mod, name, parallel, 0, blocks)
            mod.shard = latent_column
            kinds[f"{name}.lora_A"], kinds[f"{name}.lora_B"] = PARTIAL, SHARDED_ROWS
        elif isinstance(mod, LoraLinear) and ".layers." in name:
            if leaf in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
                _split(mod, name, parallel, 0, blocks)
                mod.shard = column
                kinds[f"{name}.lora_A"], kinds[f"{name}.lora_B"] = PARTIAL, SHARDED_ROWS
            elif leaf in ("o_proj", "down_proj"):
                _split(mod, name, parallel, 1, blocks)
                mod.shard = row
                kinds[f"{name}.lora_A"], kinds[f"{name}.lora_B"] = SHARDED_COLS, PARTIAL
        elif isinstance(mod, GatedDeltaNet):
            _shard_gated_deltanet(mod, name, parallel, blocks, kinds, pieces, column, row)
        elif leaf == "self_attn" and cfg.model_type == "olmo3":
            for norm in ("q_norm", "k_norm"):
                start, end = parallel.layout.tp_range(getattr(mod, norm).weight.shape[0])
                setattr(mod, norm, ShardedRMSNorm(getattr(mod, norm), start, end, parallel.tp_group))
                blocks[f"{name}.{norm}.weight"] = (0, start, end - start)
    _split_vocab(model, parallel, blocks, kinds)
    return kinds, pieces
