"""DeepSeek-V3's ``noaux_tc`` router: sigmoid scores, a selection-only correction bias and
group-limited top-k (spec §4.2; transformers ``DeepseekV3TopkRouter``).

::

    s   = σ(h Wᵀ)                     fp32, [T, E]
    s'  = s + b                       b = e_score_correction_bias, used only to choose experts
    group score = sum of the top-2 s' in each of n_group groups; keep the best topk_group groups
    idx = top-k of s' over the kept groups (the others masked to -inf)
    w   = s[idx] / (Σ s[idx] + 1e-20) if norm_topk_prob, then × routed_scaling_factor

The router weight and the bias are frozen (never LoRA targets). The bias stays fp32 whatever the
model dtype, as transformers keeps it (``_keep_in_fp32_modules_strict``): it decides near-ties.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ember.core.layers.moe import Routing, replayed


class GroupLimitedSigmoidRouter(nn.Module):
    """Sigmoid router with correction bias and group-limited top-k (``noaux_tc``)."""

    def __init__(
        self,
        hidden: int,
        num_experts: int,
        top_k: int,
        n_group: int = 1,
        topk_group: int = 1,
        norm_topk_prob: bool = True,
        routed_scaling_factor: float = 1.0,
    ):
        super().__init__()
        if num_experts % n_group:
            raise ValueError(f"n_routed_experts {num_experts} is not divisible by n_group {n_group}")
        if not 1 <= topk_group <= n_group:
            raise ValueError(f"topk_group {topk_group} must be in 1..n_group ({n_group})")
        if top_k > topk_group * (num_experts // n_group):
            raise ValueError(f"num_experts_per_tok {top_k} exceeds the experts of {topk_group} groups")
        self.num_experts = num_experts
        self.top_k = top_k
        self.n_group = n_group
        self.topk_group = topk_group
        self.norm_topk_prob = norm_topk_prob
        self.routed_scaling_factor = routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(num_experts, hidden), requires_grad=False)
        # a frozen parameter (not a buffer) so checkpoints load it by name; kept fp32 at load
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts), requires_grad=False)

    def select(self, scores: torch.Tensor) -> torch.Tensor:
        """Expert ids ``[T, k]`` chosen from sigmoid ``scores`` ``[T, E]`` (fp32)."""
        biased = scores + self.e_score_correction_bias.float()
        T, G = biased.shape[0], self.n_group
        grouped = biased.view(T, G, self.num_experts // G)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0).bool()
        keep = group_mask[:, :, None].expand_as(grouped).reshape(T, self.num_experts)
        biased = biased.masked_fill(~keep, float("-inf"))
        return torch.topk(biased, k=self.top_k, dim=-1, sorted=False)[1]

    def forward(self, x: torch.Tensor, replay: torch.Tensor | None = None) -> Routing:
        """Route ``x``; with ``replay`` (``[T, k]`` expert ids, ``-1`` rows live; R3) keep those
        experts and weight them by the live scores (the bias only ever selects)."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        live = self.select(scores)
        idx = replayed(live, replay)
        w = scores.gather(1, idx)
        if self.norm_topk_prob:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        w = w * self.routed_scaling_factor
        return Routing(experts=idx, weights=w.to(x.dtype), live=live if replay is not None else None)
