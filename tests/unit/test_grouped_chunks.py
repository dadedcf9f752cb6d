"""Grouped products over more groups than one ``torch._grouped_mm`` call takes (the CUDA kernels
refuse more than 1024: (expert, adapter) pairs of a 512-expert model with two adapters) run as
several calls; the limit is lowered here so the CPU's grouped kernel takes the same path."""

from __future__ import annotations

import pytest
import torch

from ember.core.kernels import grouped


def _loop_linear(x, w, ends):
    out, start = torch.zeros(x.shape[0], w.shape[1]), 0
    for g, end in enumerate(ends):
        out[start:end] = x[start:end] @ w[g].T
        start = end
    return out


@pytest.mark.parametrize("limit", [1, 3, 4, 64])
def test_grouped_products_in_chunks_equal_one_call(limit, monkeypatch):
    g = torch.Generator().manual_seed(limit)
    sizes = [3, 0, 5, 1, 0, 0, 7, 2, 4, 0, 6]  # empty groups, one at a chunk border
    ends = torch.cumsum(torch.tensor(sizes), 0).to(torch.int32)
    x = torch.randn(sum(sizes), 8, generator=g)
    w = torch.randn(len(sizes), 12, 8, generator=g)
    gy = torch.randn(sum(sizes), 12, generator=g)
    ref_y = _loop_linear(x, w, ends.tolist())
    ref_gw = torch.stack([gy[a:b].T @ x[a:b] for a, b in zip([0, *ends.tolist()[:-1]], ends.tolist())])
    monkeypatch.setattr(grouped, "MAX_GROUPS", limit)
    assert grouped.grouped_mm_supported(x, w)
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    torch.testing.assert_close(grouped.grouped_linear(x, w, ends), ref_y, atol=1e-5, rtol=1e-5)
    assert len(calls) == -(-len(sizes) // limit)
    torch.testing.assert_close(grouped.grouped_wgrad(gy, x, ends), ref_gw, atol=1e-5, rtol=1e-5)
