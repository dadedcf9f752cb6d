"""The order in which a run visits its training examples.

Position ``p`` (examples consumed so far) maps to an example index: a synthetic stream is visited
in order; a finite dataset in epochs, each a permutation drawn from ``(seed, epoch)``. The mapping
depends on nothing else, so a checkpoint's data position is enough to resume exactly.
"""

from __future__ import annotations

import numpy as np


class DataOrder:
    """Example index of each data position (``size=None``: an endless stream, index = position)."""

    def __init__(self, size: int | None, seed: int):
        if size is not None and size < 1:
            raise ValueError("the dataset is empty")
        self.size, self.seed = size, seed
        self._epoch, self._perm = -1, np.empty(0, dtype=np.int64)

    def index(self, position: int) -> int:
        if self.size is None:
            return position
        epoch, i = divmod(position, self.size)
        if epoch != self._epoch:
            self._epoch, self._perm = epoch, np.random.default_rng([self.seed, epoch]).permutation(self.size)
        return int(self._perm[i])
