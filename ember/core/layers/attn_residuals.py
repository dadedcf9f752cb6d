"""Block attention residuals (Kimi "Attention Residuals", arXiv:2603.15031; spec §2.2).

Instead of one running residual stream, the model keeps the *completed blocks* (the embedding, then
the sum of each finished block of layers) and the *partial block* (the running sum of the current
block). A sublayer reads a mixture of them, weighted per token by a learned pseudo-query::

    n_i = RMSNorm(source_i)                       (no weight, eps 1e-6, fp32)
    α   = softmax_i( w · n_i / sqrt(H) )          (one query w per mixture)
    h   = Σ_i α_i · n_i

Transformers' ``Inkling2BlockAttentionResidual`` is the reference; note that it mixes the
*normalised* sources. Completed blocks are normalised once, when they are added to the bank, and
each normalised block is one tensor shared by every later mixture (autograd saves it once).
"""

from __future__ import annotations

import torch
from torch import nn

EPS = 1e-6


def _unit_rms(x: torch.Tensor) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + EPS)


class ResidualBank:
    """The completed blocks of one forward pass, each kept RMS-normalised in fp32 (``[T, H]``)."""

    def __init__(self):
        self.normed: list[torch.Tensor] = []

    def append(self, block: torch.Tensor) -> None:
        """Close a block: ``block`` (``[T, H]``, any dtype) becomes a source of later mixtures."""
        self.normed.append(_unit_rms(block))

    def __len__(self) -> int:
        return len(self.normed)


class BlockAttentionResidual(nn.Module):
    """Mixtures of the bank and the partial block, one per pseudo-query (``query`` ``[H]`` or
    ``[n, H]``, as in the checkpoint)."""

    def __init__(self, hidden: int, num_queries: int = 1):
        super().__init__()
        self.query = nn.Parameter(torch.zeros(hidden) if num_queries == 1 else torch.zeros(num_queries, hidden))

    def forward(self, bank: ResidualBank, partial: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``partial`` ``[T, H]`` -> one fp32 mixture ``[T, H]`` per query."""
        hidden = partial.shape[-1]
        queries = self.query.float().view(-1, hidden) * hidden**-0.5  # [n, H]
        sources = [*bank.normed, _unit_rms(partial)]
        logits = torch.stack([s @ queries.T for s in sources], dim=1)  # [T, S, n]
        alpha = torch.softmax(logits, dim=1)
        mixed = [sum(alpha[:, i, q, None] * s for i, s in enumerate(sources)) for q in range(queries.shape[0])]
        return tuple(mixed)
