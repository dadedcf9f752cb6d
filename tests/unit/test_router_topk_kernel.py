"""The router's top-k kernel (ember.core.kernels.router_topk, CUDA path) under Triton's interpreter:
the indices of the k largest scores of each row, largest first, equal scores to the lower column
and NaN as +inf, against a sort by (-score, column); and a softmax router through it against the
same router through torch.topk."""

import textwrap

import pytest

from tests.triton_interp import run_interpreted

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import numpy as np
    import torch
    from ember.core.kernels import router_topk
    from tests.triton_interp import patch_interpreter
    patch_interpreter()
    torch.manual_seed(0)

    def reference(scores, k):
        s = scores.double().numpy()
        s = np.where(np.isnan(s), np.inf, s)
        cols = np.arange(s.shape[1])
        return torch.tensor(np.stack([np.lexsort((cols, -row))[:k] for row in s]), dtype=torch.int64)

    # rows not a multiple of the row block, widths below and at a power of two, many equal scores
    for T, E, k in ((37, 60, 4), (9, 512, 10), (5, 8, 8), (3, 128, 1)):
        scores = torch.randint(0, 6, (T, E)).float() / 5  # ties within and across the top k
        scores[0, :3] = float("nan")
        scores[1, 1] = float("-inf")
        scores[2] = float("-inf")  # a row of nothing but -inf still names k distinct columns
        got = router_topk.topk_indices(scores, k)
        assert got.dtype == torch.int64 and got.shape == (T, k)
        assert torch.equal(got, reference(scores, k)), (T, E, k)
        # a strided view reads the same rows
        wide = torch.zeros(T, 2 * E)
        wide[:, ::2] = scores
        assert torch.equal(router_topk.topk_indices(wide[:, ::2], k), got)
    assert router_topk.topk_indices(torch.zeros(0, 16), 2).shape == (0, 2)

    # a Qwen3-MoE router through the kernel against torch.topk: the same experts, weights, gradients
    from ember.core.config import MoEConfig
    from ember.core.layers.moe import SoftmaxTopKRouter
    cfg = MoEConfig(num_experts=24, top_k=5, intermediate_size=8, norm_topk_prob=True)
    router = SoftmaxTopKRouter(16, cfg)
    torch.nn.init.normal_(router.weight)
    x = torch.randn(11, 16, requires_grad=True)
    outs = []
    for kernel in (True, False):
        router_topk.available = (lambda *a: True) if kernel else (lambda *a: False)
        r = router(x)
        (gx,) = torch.autograd.grad((r.weights * torch.arange(5.0)).sum(), x)
        outs.append((r.experts, r.weights.detach(), gx))
    (e1, w1, g1), (e0, w0, g0) = outs
    assert torch.equal(e1, e0) and torch.equal(w1, w0) and torch.equal(g1, g0)
    print("ok")
    """
)


def test_router_topk_kernel_under_interpreter():
    assert "ok" in run_interpreted(SCRIPT)
