"""Mixture-of-experts block: router, grouped expert products, per-expert LoRA.

Tokens are dispatched as (token, k) rows sorted by expert; the experts run as one grouped product per
projection (``torch._grouped_mm`` on Hopper). When the batch mixes adapters the rows are sorted by
(expert, adapter group) so that each expert's rows stay contiguous for the base product and each
(expert, adapter) pair is contiguous for its LoRA product.

Weights follow the transformers 5 layout: ``gate_up_proj`` ``[E, 2I, H]`` (gate rows first) and
``down_proj`` ``[E, H, I]``; expert LoRA adapts those two stacked parameters (PEFT's
``target_parameters``), with factors ``A`` ``[E, r, in]`` and ``B`` ``[E, out, r]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ember.core.config import MoEConfig
from ember.core.kernels import expert_decode, gathered_wgrad, grouped_lora, router_topk
from ember.core.kernels import sum_rows as row_kernels
from ember.core.kernels.grouped import grouped_linear, grouped_wgrad
from ember.core.layers.activations import silu_mul_packed
from ember.core.layers.lora import LoraRoute


@dataclass
class Routing:
    """The experts chosen for each token (``[T, k]``) and their mixing weights; ``live``: what the
    router itself would have chosen, when a replay overrode it."""

    experts: torch.Tensor
    weights: torch.Tensor
    live: torch.Tensor | None = None


def replayed(live: torch.Tensor, replay: torch.Tensor | None) -> torch.Tensor:
    """The experts a pass uses: ``replay``'s (``[T, k]``) on rows that hold a recorded choice, the
    live router's ``live`` on rows marked ``-1`` (tokens without a record)."""
    if replay is None:
        return live
    replay = replay.to(device=live.device, dtype=torch.long)
    return torch.where(replay[:, :1] >= 0, replay, live)


@dataclass
class RoutingRecord:
    """MoE routing of a pass, per MoE layer index.

    * ``record``: filled with the experts each MoE layer used (``[T, k]``).
    * ``replay``: experts to use instead (rollout routing replay, R3; ``[T, k]``, rows of ``-1``
      route live). Only the choice is replayed: the mixing weights come from the live router's
      scores over the replayed experts, so gradients still flow through the router.
    * ``reference``: recorded experts (``[T, k]``, ``-1`` rows: none) to compare the live router
      with; ``flips`` is then filled with ``[T]`` booleans: the live router chooses another set of
      experts than the reference for that token (whether or not the pass replays it).
    """

    record: dict[int, torch.Tensor] | None = None
    replay: dict[int, torch.Tensor] | None = None
    reference: dict[int, torch.Tensor] | None = None
    flips: dict[int, torch.Tensor] | None = None

    def route(self, layer: int, gate: nn.Module, x: torch.Tensor) -> Routing:
        """Run MoE layer ``layer``'s router ``gate`` on ``x`` with this pass's replay and records."""
        replay = self.replay.get(layer) if self.replay else None
        r = gate(x, replay)
        if self.record is not None:
            self.record[layer] = r.experts.detach()
        ref = self.reference.get(layer) if self.reference else None
        if ref is not None and self.flips is not None:
            ref = ref.to(device=x.device, dtype=torch.long)
            live = r.experts if r.live is None else r.live
            differ = (live.sort(dim=-1).values != ref.sort(dim=-1).values).any(dim=-1)
            self.flips[layer] = differ & (ref[:, 0] >= 0)
        return r


def route(layer: int, gate: nn.Module, x: torch.Tensor, routing: RoutingRecord | None) -> Routing:
    """``gate(x)`` under ``routing`` (record / replay), or the live router when it is None."""
    return gate(x) if routing is None else routing.route(layer, gate, x)


class SoftmaxTopKRouter(nn.Module):
    """Qwen-style router: softmax over all experts in fp32, top-k, optional renormalisation."""

    def __init__(self, hidden: int, cfg: MoEConfig):
        super().__init__()
        self.top_k = cfg.top_k
        self.norm_topk_prob = cfg.norm_topk_prob
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, hidden), requires_grad=False)

    def forward(self, x: torch.Tensor, replay: torch.Tensor | None = None) -> Routing:
        """Route ``x``; with ``replay`` (``[T, k]`` expert ids, ``-1`` rows live: :func:`replayed`)
        keep those experts and take their weights from the live probabilities, so gradients still
        reach the router (R3)."""
        logits = F.linear(x, self.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        live = router_topk.topk_indices(probs, self.top_k)
        idx = replayed(live, replay)
        top = probs.gather(1, idx)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return Routing(experts=idx, weights=top.to(logits.dtype), live=live if replay is not None else None)


class _ExpertProjection(torch.autograd.Function):
    """One grouped expert projection with its LoRA correction, keeping little for backward.

    ``y = xs @ W[e].T + (s_row · xs @ A[g].T) @ B[g].T`` where ``xs = x[rows]`` (the gathered input
    rows), ``e`` the expert of a row and ``g`` its LoRA group. The gathered ``[T·k, H]`` rows are
    NOT kept: backward reads them from ``x`` by index (:mod:`ember.core.kernels.gathered_wgrad`, on
    CUDA) or gathers them again. That, folding the routing weights into the activation
    (:meth:`Experts.activation`) and rebuilding the activation's output (:mod:`ember.core.rebuild`)
    keep an MoE layer's saved activations near ``[T·k, 2·I]`` instead of ``[T·k, 2·H + 3·I]``.

    On CUDA the correction is added into the base product's rows in place, in one pass
    (:mod:`ember.core.kernels.grouped_lora`), and the same for the input's two gradients. Elsewhere,
    with ``split`` the base product and the correction come back apart (the combine sums both in one
    pass), and the backward sums the input's two gradients into ``x``'s rows in one pass too.
    """

    @staticmethod
    def forward(ctx, x, rows, weight, offsets, lora_offsets, lora_scale, A, B, inverse=None, split=False):
        ctx.inverse = inverse  # rows' inverse permutation (ExpertRows.inverse): gx sums them without atomics
        ctx.split = split
        xs = x if rows is None else x[rows]
        y = grouped_linear(xs, weight, offsets)
        h = correction = None
        ctx.folded = False  # the correction added into y's rows in place (so it has y's gradient)
        if A is not None:
            h = grouped_linear(xs, A, lora_offsets) * lora_scale[:, None]
            if grouped_lora.available(y, h, B):
                grouped_lora.expand_add(y, h, B, lora_offsets)
                ctx.folded = True
            else:
                correction = grouped_linear(h, B, lora_offsets)
                if not split:
                    y = y + correction
        ctx.save_for_backward(x, rows, weight, offsets, lora_offsets, lora_scale, A, B, h)
        return (y, correction) if split else y

    @staticmethod
    def backward(ctx, gy, g_correction=None):
        x, rows, weight, offsets, lora_offsets, lora_scale, A, B, h = ctx.saved_tensors
        if not ctx.split or ctx.folded:
            g_correction = gy
        xs = x if rows is None else None  # the gathered rows, made again only where a product needs them

        def gathered():
            nonlocal xs
            if xs is None:
                xs = x[rows]
            return xs

        gxs = grouped_linear(gy, weight.transpose(1, 2), offsets)
        gW = grouped_wgrad(gy, gathered(), offsets) if ctx.needs_input_grad[2] else None
        gA = gB = gxs_lora = None
        if A is not None and g_correction is not None:
            gh = grouped_linear(g_correction, B.transpose(1, 2), lora_offsets)
            gB = grouped_wgrad(g_correction, h, lora_offsets)
            gh = gh * lora_scale[:, None]
            A_t = A.transpose(1, 2)
            if grouped_lora.available(gxs, gh, A_t):
                grouped_lora.expand_add(gxs, gh, A_t, lora_offsets)  # the input's two gradients, one pass
            else:
                gxs_lora = grouped_linear(gh, A_t, lora_offsets)
            if rows is not None and gathered_wgrad.available(gh, x):
                gA = gathered_wgrad.wgrad_gathered(gh, x, rows, lora_offsets)  # x's rows read by index
            else:
                gA = grouped_wgrad(gh, gathered(), lora_offsets)
        if rows is not None and ctx.inverse is not None:
            # each token's rows summed with the correction's in one pass (no [T·k, H] sum first)
            gx = sum_rows(gxs, ctx.inverse, x.shape[0], extra=gxs_lora).to(x.dtype)
        else:
            if gxs_lora is not None:
                gxs = gxs + gxs_lora
            gx = gxs if rows is None else torch.zeros_like(x).index_add_(0, rows, gxs)
        return gx, None, gW, None, None, None, gA, gB, None, None


def sum_rows(rows: torch.Tensor, inverse: torch.Tensor, tokens: int, fp32: bool = False,
             extra: torch.Tensor | None = None) -> torch.Tensor:
    """Each token's sum of its ``k`` rows (of ``rows + extra`` when ``extra`` is given: an expert
    product and its LoRA correction): ``inverse[t * k + j]`` is the row of token ``t``'s ``j``-th
    choice (every token has exactly ``k``). Accumulated in fp32 and rounded once (to fp32 with
    ``fp32``), instead of ``index_add_``'s atomic adds; deterministic. On CUDA one Triton kernel
    reads each row once (:mod:`ember.core.kernels.sum_rows`; the sum with ``extra`` is not rounded
    first); elsewhere ``rows + extra``, a gather and a reduction. (``embedding_bag`` computes the
    plain sum in one kernel, but took 0.72 ms against 0.47 ms for gather + sum on an H200 at 16k
    tokens, top-8, hidden 2048: ``bench/moe_parts.py``.)"""
    if row_kernels.available(rows):
        return row_kernels.sum_rows(rows, inverse, tokens, torch.float32 if fp32 else rows.dtype, extra)
    if extra is not None:
        rows = rows + extra
    picked = rows[inverse].view(tokens, -1, rows.shape[-1])
    return picked.float().sum(1) if fp32 else picked.sum(1)


class _CombineRows(torch.autograd.Function):
    """:func:`sum_rows` (of ``rows + extra``) whose backward hands each row its token's gradient (a
    gather: the autograd of ``rows[inverse]`` would scatter with atomics), the same for both."""

    @staticmethod
    def forward(ctx, rows, inverse, token, tokens: int, fp32: bool, extra=None):
        ctx.save_for_backward(token)
        ctx.dtype = rows.dtype
        return sum_rows(rows, inverse, tokens, fp32, extra)

    @staticmethod
    def backward(ctx, g):
        (token,) = ctx.saved_tensors
        grows = g[token].to(ctx.dtype)
        return grows, None, None, None, None, grows if ctx.needs_input_grad[5] else None


def pair_ends(sorted_key: torch.Tensor, pairs: int) -> torch.Tensor:
    """Cumulative row ends (int32, ``[pairs]``) of keys ``0 .. pairs-1`` in rows sorted by key: a
    grouped product's offsets. Found by binary search on the device; ``bincount`` reads its
    input's maximum back to the host, a sync in every MoE layer (and no CUDA-graph capture)."""
    bounds = torch.arange(1, pairs + 1, device=sorted_key.device, dtype=sorted_key.dtype)
    return torch.searchsorted(sorted_key, bounds).to(torch.int32)


@dataclass
class ExpertRows:
    """The (token, k) rows of an MoE layer sorted by (expert, adapter group).

    ``token``/``weight``/``group``: each sorted row's token, routing weight and adapter group;
    ``key``: its ``expert * groups + group``; ``groups``: the number of adapter groups;
    ``inverse``: the sort's inverse permutation (``inverse[t * k + j]``: the sorted row of token
    ``t``'s ``j``-th choice), with which a token's rows are summed without atomics."""

    token: torch.Tensor
    weight: torch.Tensor
    group: torch.Tensor
    key: torch.Tensor
    groups: int
    inverse: torch.Tensor | None = None

    @staticmethod
    def sort(routing: Routing, lora: LoraRoute | None, token_group: torch.Tensor | None = None) -> ExpertRows:
        """The rows of ``routing`` (``[T, k]``); ``token_group``: each token's adapter group
        (default: the route's)."""
        T, k = routing.experts.shape
        flat_expert = routing.experts.reshape(-1)
        # each token k times (an expand: no output size to read back, so a decode step can be captured)
        flat_token = torch.arange(T, device=flat_expert.device)[:, None].expand(T, k).reshape(-1)
        groups = len(lora.moe_adapters) if lora is not None else 1
        if groups > 1:
            row_group = (lora.moe_token_group() if token_group is None else token_group)[flat_token]
            key = flat_expert * groups + row_group
        else:
            row_group = torch.zeros_like(flat_expert)
            key = flat_expert
        order = torch.argsort(key, stable=True)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        return ExpertRows(flat_token[order], routing.weights.reshape(-1)[order], row_group[order], key[order], groups,
                          inverse)


class Experts(nn.Module):
    """Stacked gated experts (SwiGLU by default), run as grouped products.

    Families change the gate activation by overriding :meth:`activation`, and may sum the top-k
    outputs in fp32 (``accumulate_fp32``) where their reference does.

    ``dispatch`` (default ``None``: every expert is here) is set from outside when the experts are
    sharded across processes (:mod:`ember.dist.expert_parallel`); the module then holds experts
    ``expert_start ..`` ``+ num_experts`` of ``global_experts``, and ``dispatch(self, x, routing,
    lora)`` moves rows to their experts' ranks, runs :meth:`compute` there and brings them back.

    ``rollout`` (default ``None``) is set from outside (:mod:`ember.core.rollout_precision`): while
    it is ``active`` (the sampler's passes) :meth:`compute` uses its quantised copies of the weights."""

    accumulate_fp32 = False
    dispatch = None
    rollout = None

    def __init__(self, hidden: int, intermediate: int, num_experts: int):
        super().__init__()
        self.num_experts = num_experts
        self.global_experts = num_experts
        self.expert_start = 0
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate), requires_grad=False)
        self.lora_name = ""
        self.category = "mlp"

    def lora_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each adaptable stacked parameter, keyed by its LoRA name suffix."""
        _, two_i, h = self.gate_up_proj.shape
        return {"gate_up_proj": (h, two_i), "down_proj": (two_i // 2, h)}

    def activation(self, gate_up: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        """The gated activation between the two projections, of the gate_up product (``[rows, 2·I]``,
        gate first), each row times ``scale`` (its routing weight; the down projection is linear,
        so scaling its input is scaling its output)."""
        return silu_mul_packed(gate_up, scale)

    def forward(self, x: torch.Tensor, routing: Routing, lora: LoraRoute | None) -> torch.Tensor:
        if self.dispatch is not None:
            return self.dispatch(self, x, routing, lora)
        rows = ExpertRows.sort(routing, lora)
        out, correction = self.compute(x, rows.token, rows.weight, rows.key, rows.group, rows.groups, lora,
                                       rows.inverse, split=True)
        return self.combine(x, rows.token, out, rows.inverse, correction)

    def compute(
        self,
        x: torch.Tensor,
        rows: torch.Tensor | None,
        weight: torch.Tensor,
        key: torch.Tensor,
        group: torch.Tensor,
        groups: int,
        lora: LoraRoute | None,
        inverse: torch.Tensor | None = None,
        split: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        """The weighted expert outputs of rows sorted by ``key`` = ``local expert * groups +
        group``: row ``i`` is ``x[rows[i]]`` (``rows`` None: ``x`` itself), scaled by ``weight[i]``
        (``inverse``: of ``rows``, when every token has the same number of rows; see :class:`ExpertRows`).
        With ``split``: the base products' rows and the down projection's LoRA correction apart
        (None without one), for :meth:`combine` to sum in one pass."""
        E = self.num_experts
        ends = pair_ends(key, E * groups)
        expert_offsets = ends if groups == 1 else ends.view(E, groups)[:, -1].contiguous()
        lora_offsets = ends

        def project(inp, rows, w, suffix, split=False):
            w, w_scale = w
            factors = None
            if lora is not None:
                factors = lora.expert_factors(f"{self.lora_name}.{suffix}", group, inp.dtype)
            if w_scale is not None or expert_decode.takes(inp, rows, w):
                # decode-shaped, without gradients (or the fp8 rollout copy, ``w_scale`` its tile
                # scales): each expert's weight streamed once against its few rows, gathered by
                # index in the kernel, the LoRA term added in the same pass (expert_decode)
                extra = None if factors is None else expert_decode.ExpertLora(*factors, group, groups, lora_offsets)
                y = expert_decode.expert_product(inp, rows, w, expert_offsets, w_scale, extra)
                return (y, None) if split else y
            inv = inverse if rows is not None else None
            if factors is None:
                y = _ExpertProjection.apply(inp, rows, w, expert_offsets, None, None, None, None, inv)
                return (y, None) if split else y
            A, B, scale_rows = factors
            return _ExpertProjection.apply(inp, rows, w, expert_offsets, lora_offsets, scale_rows, A, B, inv, split)

        # (weight, its fp8 tile scales or None): the rollout copies while the sampler uses them
        gate_up_w, down_w = (self.gate_up_proj, None), (self.down_proj, None)
        if self.rollout is not None and self.rollout.active:
            gate_up_w, down_w = self.rollout.weights()
        gate_up = project(x, rows, gate_up_w, "gate_up_proj")
        # the routing weight scales the down projection's input rows (same result: it is linear)
        return project(self.activation(gate_up, weight), None, down_w, "down_proj", split)

    def combine(self, x: torch.Tensor, token: torch.Tensor, out: torch.Tensor,
                inverse: torch.Tensor | None = None, correction: torch.Tensor | None = None) -> torch.Tensor:
        """Sum each token's rows of ``out`` (plus ``correction``'s: :meth:`compute`'s ``split``; row
        ``i`` belongs to token ``token[i]``; with ``inverse`` (:class:`ExpertRows`) by
        :func:`sum_rows`, else by ``index_add_``)."""
        if inverse is not None:
            return _CombineRows.apply(out, inverse, token, x.shape[0], self.accumulate_fp32, correction).to(x.dtype)
        if correction is not None:
            out = out + correction
        if self.accumulate_fp32:
            return x.new_zeros(x.shape, dtype=torch.float32).index_add_(0, token, out.float()).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, token, out)


class SparseMoE(nn.Module):
    """Router + routed experts (Qwen3-MoE)."""

    def __init__(self, hidden: int, cfg: MoEConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.gate = SoftmaxTopKRouter(hidden, cfg)
        self.experts = Experts(hidden, cfg.intermediate_size, cfg.num_experts)

    def forward(self, x: torch.Tensor, lora: LoraRoute | None, routing: RoutingRecord | None = None) -> torch.Tensor:
        return self.experts(x, route(self.layer, self.gate, x, routing), lora)
