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
from ember.core.kernels.grouped import grouped_linear, grouped_wgrad, offsets_from_sizes
from ember.core.layers.activations import silu_mul
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
        top, live = torch.topk(probs, self.top_k, dim=-1)
        idx = replayed(live, replay)
        if replay is not None:
            top = probs.gather(1, idx)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return Routing(experts=idx, weights=top.to(logits.dtype), live=live if replay is not None else None)


class _ExpertProjection(torch.autograd.Function):
    """One grouped expert projection with its LoRA correction, keeping little for backward.

    ``y = xs @ W[e].T + (s_row · xs @ A[g].T) @ B[g].T`` where ``xs = x[rows] * in_scale`` (the
    gathered, optionally row-scaled input), ``e`` the expert of a row and ``g`` its LoRA group. The
    gathered ``[T·k, H]`` rows are NOT kept: backward gathers them again from ``x``. That, and folding
    the routing weights into the down projection's input (``in_scale``), keeps an MoE layer's saved
    activations near ``[T·k, 3·I]`` instead of ``[T·k, 2·H + 3·I]``.
    """

    @staticmethod
    def forward(ctx, x, rows, in_scale, weight, offsets, lora_offsets, lora_scale, A, B):
        xs = x if rows is None else x[rows]
        if in_scale is not None:
            xs = xs * in_scale[:, None].to(xs.dtype)
        y = grouped_linear(xs, weight, offsets)
        h = None
        if A is not None:
            h = grouped_linear(xs, A, lora_offsets) * lora_scale[:, None]
            y = y + grouped_linear(h, B, lora_offsets)
        ctx.save_for_backward(x, rows, in_scale, weight, offsets, lora_offsets, lora_scale, A, B, h)
        return y

    @staticmethod
    def backward(ctx, gy):
        x, rows, in_scale, weight, offsets, lora_offsets, lora_scale, A, B, h = ctx.saved_tensors
        base = x if rows is None else x[rows]
        xs = base if in_scale is None else base * in_scale[:, None].to(base.dtype)
        gxs = grouped_linear(gy, weight.transpose(1, 2), offsets)
        gW = grouped_wgrad(gy, xs, offsets) if ctx.needs_input_grad[3] else None
        gA = gB = None
        if A is not None:
            gh = grouped_linear(gy, B.transpose(1, 2), lora_offsets)
            gB = grouped_wgrad(gy, h, lora_offsets)
            gh = gh * lora_scale[:, None]
            gxs = gxs + grouped_linear(gh, A.transpose(1, 2), lora_offsets)
            gA = grouped_wgrad(gh, xs, lora_offsets)
        g_scale = None
        if in_scale is not None:
            if ctx.needs_input_grad[2]:
                g_scale = (gxs.float() * base.float()).sum(-1).to(in_scale.dtype)
            gxs = gxs * in_scale[:, None].to(gxs.dtype)
        gx = gxs if rows is None else torch.zeros_like(x).index_add_(0, rows, gxs)
        return gx, None, g_scale, gW, None, None, None, gA, gB


class Experts(nn.Module):
    """Stacked gated experts (SwiGLU by default), run as grouped products.

    Families change the gate activation by overriding :meth:`activation`, and may sum the top-k
    outputs in fp32 (``accumulate_fp32``) where their reference does."""

    accumulate_fp32 = False

    def __init__(self, hidden: int, intermediate: int, num_experts: int):
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate), requires_grad=False)
        self.lora_name = ""
        self.category = "mlp"

    def lora_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each adaptable stacked parameter, keyed by its LoRA name suffix."""
        _, two_i, h = self.gate_up_proj.shape
        return {"gate_up_proj": (h, two_i), "down_proj": (two_i // 2, h)}

    def activation(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The gated activation between the two projections."""
        return silu_mul(gate, up)

    def forward(self, x: torch.Tensor, routing: Routing, lora: LoraRoute | None) -> torch.Tensor:
        T = x.shape[0]
        k = routing.experts.shape[1]
        flat_expert = routing.experts.reshape(-1)
        flat_token = torch.arange(T, device=x.device).repeat_interleave(k)
        groups = len(lora.groups) if lora is not None else 1
        if groups > 1:
            row_group = lora.token_group()[flat_token]
            key = flat_expert * groups + row_group
        else:
            row_group = torch.zeros_like(flat_expert)
            key = flat_expert
        order = torch.argsort(key, stable=True)
        token = flat_token[order]
        row_group = row_group[order]
        expert_offsets = offsets_from_sizes(torch.bincount(flat_expert, minlength=self.num_experts), x.device)
        pair_offsets = expert_offsets
        if groups > 1:
            pair_offsets = offsets_from_sizes(torch.bincount(key, minlength=self.num_experts * groups), x.device)

        def project(inp, rows, in_scale, weight, suffix):
            factors = None
            if lora is not None:
                factors = lora.expert_factors(f"{self.lora_name}.{suffix}", row_group, inp.dtype)
            if factors is None:
                return _ExpertProjection.apply(inp, rows, in_scale, weight, expert_offsets, None, None, None, None)
            A, B, scale_rows = factors
            lora_offsets = expert_offsets if groups == 1 else pair_offsets
            return _ExpertProjection.apply(inp, rows, in_scale, weight, expert_offsets, lora_offsets, scale_rows, A, B)

        gate, up = project(x, token, None, self.gate_up_proj, "gate_up_proj").chunk(2, dim=-1)
        weights = routing.weights.reshape(-1)[order]
        # the routing weight scales the down projection's input rows (same result: it is linear)
        out = project(self.activation(gate, up), None, weights, self.down_proj, "down_proj")
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
