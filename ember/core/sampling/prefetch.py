"""The next base product's weight fetched into L2 while a decode step runs its small kernels.

Between two base products a decode layer runs a dozen latency-bound kernels (a norm, the LoRA
shrink and expand, the q/k norms and rotations, the KV write, the SwiGLU kernel, a residual add),
and HBM idles through them. :class:`WeightPrefetch` forks a side stream right after each product
is queued; once that product is done, the side stream starts an L2 prefetch of part of the next
product's weight (:func:`~ember.core.kernels.l2_prefetch.prefetch`), which the small kernels on the
main stream do not wait for. The step's main stream joins the side stream at its end, so the
prefetches are part of the captured graph.

"The next product" is learnt from the decoder's first pass: the products come in the same order in
every step (the layers in order, the LM head last, then the first layer of the next step), so the
first pass records which weight follows which (keyed by the weight's address). A product whose
weight is not in that map prefetches nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ember.core.kernels import l2_prefetch


class WeightPrefetch:
    """Prefetches about ``budget`` bytes of the next product's weight after each product
    (``launch(weight, budget)``, :func:`~ember.core.kernels.l2_prefetch.prefetch` by default, with
    its ``evict_last`` policy if asked).

    Use: :meth:`begin` before a pass, :meth:`after` right after each base product is queued,
    :meth:`end` after the pass (it joins the side stream)."""

    def __init__(self, budget: int, launch: Callable[[torch.Tensor, int], None] | None = None,
                 evict_last: bool = False):
        self.budget = budget
        self.launch = launch or (lambda w, b: l2_prefetch.prefetch(w, b, evict_last))
        self.next: dict[int, torch.Tensor] | None = None  # weight address -> the weight read after it
        self._pass: list[torch.Tensor] = []
        self._side: torch.cuda.Stream | None = None
        self._forked = False

    def begin(self) -> None:
        self._pass = []
        self._forked = False

    def after(self, weight: torch.Tensor) -> None:
        """``weight``'s product is queued: prefetch part of the weight that follows it (the first
        pass only records the order)."""
        if self.next is None:
            self._pass.append(weight)
            return
        nxt = self.next.get(weight.data_ptr())
        if nxt is None:
            return
        if not weight.is_cuda:
            self.launch(nxt, self.budget)
            return
        if self._side is None:
            self._side = torch.cuda.Stream(device=weight.device)
        self._side.wait_stream(torch.cuda.current_stream())  # after this product, not during it
        with torch.cuda.stream(self._side):
            self.launch(nxt, self.budget)
        self._forked = True

    def end(self) -> None:
        if self.next is None and self._pass:  # the first pass: learn the order (the last wraps around)
            order = self._pass
            self.next = {w.data_ptr(): order[(i + 1) % len(order)] for i, w in enumerate(order)}
        if self._forked:
            torch.cuda.current_stream().wait_stream(self._side)
        self._pass = []
        self._forked = False
