"""Grouped matrix products: one launch for many (rows, weight) groups.

``torch._grouped_mm`` runs the groups of a jagged batch in one kernel on Hopper (bf16) and on the CPU
(fp32). Where it cannot run (other dtypes, misaligned shapes, older GPUs) we fall back to a loop of
plain matmuls, which computes the same thing.
"""

from __future__ import annotations

import torch


def _aligned(t: torch.Tensor) -> bool:
    return all((s * t.element_size()) % 16 == 0 for s in t.shape[-2:])


def grouped_mm_supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` can run ``x`` against stacked weights ``w`` on this device."""
    if not hasattr(torch, "_grouped_mm") or x.dtype != w.dtype:
        return False
    if not (_aligned(x) and _aligned(w)):
        return False
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device)[0] >= 9
    if x.device.type == "cpu":
        return x.dtype == torch.float32
    return False


def offsets_from_sizes(sizes: torch.Tensor | list[int], device: torch.device) -> torch.Tensor:
    """Cumulative group ends (int32), the ``offs`` argument of ``torch._grouped_mm``."""
    sizes = torch.as_tensor(sizes, device=device)
    return torch.cumsum(sizes, 0).to(torch.int32)


# groups of one torch._grouped_mm call. Its CUDA kernels refuse "more than 1024 groups", and on the
# H200 (torch 2.11) also refused some calls of exactly 1024 (a weight gradient; a 512-expert model's
# decode step with two expert groups), so calls stay at 512, as many as a 512-expert model's
# experts: (expert, adapter) pairs pass that with two adapters
MAX_GROUPS = 512


def grouped_linear(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``y[rows of group g] = x[rows of group g] @ w[g].T`` for stacked weights ``w`` of shape
    ``[G, out, in]``; ``offsets`` (int32, cumulative ends) must end at ``len(x)``.

    More than :data:`MAX_GROUPS` groups run as several calls of at most that many. A call over
    groups ``g0..g1`` reads its rows from the first row (its first group also takes the rows of
    earlier groups) and is kept for the rows from ``offsets[g0 - 1]`` on, which later calls
    overwrite past their own start: no group boundary is read back to the host, so a decode step
    stays capturable."""
    if grouped_mm_supported(x, w) and x.shape[0] > 0:
        if w.shape[0] <= MAX_GROUPS:
            return torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)
        row = torch.arange(x.shape[0], device=x.device)[:, None]
        y = None
        for g0 in range(0, w.shape[0], MAX_GROUPS):
            g1 = min(g0 + MAX_GROUPS, w.shape[0])
            part = torch._grouped_mm(x, w[g0:g1].transpose(-2, -1), offs=offsets[g0:g1].contiguous())
            y = part if y is None else torch.where(row >= offsets[g0 - 1], part, y)
        return y
    ends = offsets.tolist()
    parts, start = [], 0
    for g, end in enumerate(ends):
        if end > start:
            parts.append(x[start:end] @ w[g].transpose(-2, -1))
        start = end
    if not parts:
        return x.new_zeros(0, w.shape[1])
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def _wgrad_supported(a: torch.Tensor, b: torch.Tensor) -> bool:
    if not hasattr(torch, "_grouped_mm") or a.dtype != b.dtype:
        return False
    if (a.shape[1] * a.element_size()) % 16 or (b.shape[1] * b.element_size()) % 16:
        return False
    if a.device.type == "cuda":
        return a.dtype == torch.bfloat16 and torch.cuda.get_device_capability(a.device)[0] >= 9
    return a.device.type == "cpu" and a.dtype == torch.float32


def grouped_wgrad(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``out[g] = a[rows of g].T @ b[rows of g]`` (``[G, M, N]`` for ``a`` ``[R, M]``, ``b`` ``[R, N]``):
    the weight gradient of a grouped product. Empty groups give zeros. More than
    :data:`MAX_GROUPS` groups run as several calls, each over its own rows (their first row read
    back: a backward pass, never captured)."""
    if a.shape[0] > 0 and _wgrad_supported(a, b):
        if len(offsets) <= MAX_GROUPS:
            return torch._grouped_mm(a.t(), b, offs=offsets)
        parts = []
        for g0 in range(0, len(offsets), MAX_GROUPS):
            g1 = min(g0 + MAX_GROUPS, len(offsets))
            start = int(offsets[g0 - 1]) if g0 else 0
            parts.append(torch._grouped_mm(a[start:].t(), b[start:], offs=(offsets[g0:g1] - start).contiguous()))
        return torch.cat(parts)
    ends = offsets.tolist()
    out = a.new_zeros(len(ends), a.shape[1], b.shape[1])
    start = 0
    for g, end in enumerate(ends):
        if end > start:
            out[g] = a[start:end].T @ b[start:end]
        start = end
    return out
