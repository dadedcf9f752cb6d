"""The Gated DeltaNet short convolution's kernels (ember.core.kernels.causal_conv, CUDA path)
under Triton's interpreter: silu(causal depthwise convolution) of packed sequences, its input and
weight gradients, against the float64 PyTorch convolution (ember.core.layers.packed_conv)."""

import textwrap

import pytest

from ember.core.kernels.causal_conv import positions
from tests.triton_interp import run_interpreted

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import torch
    import torch.nn.functional as F
    from ember.core.kernels.causal_conv import positions, silu_causal_conv
    from ember.core.layers.packed_conv import causal_conv
    from tests.triton_interp import patch_interpreter
    patch_interpreter()
    torch.manual_seed(0)

    def reference(x, w, lens, dy):
        x64 = x.detach().double().requires_grad_()
        w64 = w.detach().double().requires_grad_()
        y = F.silu(causal_conv(x64, w64, lens)[0])
        dx, dw = torch.autograd.grad(y, (x64, w64), dy.double())
        return y.detach(), dx, dw

    def rel(a, b):
        return float((a.double() - b).norm() / b.norm())

    # sequences shorter than the kernel, of one token, rows and channels not multiples of the
    # tile; the input a strided cut of a wider projection; K = 4 and 3
    for lens, C, K, config in (([1, 2, 7, 3, 30], 40, 4, (16, 32, 4)), ([5], 16, 3, None), ([9, 4], 130, 4, (8, 64, 2))):
        T = sum(lens)
        pos = positions(lens)
        for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
            wide = torch.randn(T, C + 24).to(dtype)
            x = wide[:, 8:8 + C].requires_grad_()
            w = (torch.randn(C, K) * 0.5).to(dtype).requires_grad_()
            dy = torch.randn(T, C).to(dtype)
            y = silu_causal_conv(x, w, pos, config)
            dx, dw = torch.autograd.grad(y, (x, w), dy)
            ref_y, ref_dx, ref_dw = reference(x, w, lens, dy)
            assert y.dtype == dtype and y.is_contiguous() and dx.shape == x.shape and dw.dtype == dtype
            for name, got, want in (("y", y, ref_y), ("dx", dx, ref_dx), ("dw", dw, ref_dw)):
                err = rel(got.detach(), want)
                assert err < tol, (lens, C, K, dtype, name, err)
            # a frozen weight: no weight gradient asked for, the same input gradient
            (dx_frozen,) = torch.autograd.grad(silu_causal_conv(x, w.detach(), pos, config), x, dy)
            assert torch.equal(dx_frozen, dx)
    print("ok")
    """
)


def test_the_kernels_against_the_float64_convolution():
    assert run_interpreted(SCRIPT).strip().endswith("ok")


def test_positions_restart_at_each_sequence():
    assert positions([3, 1, 2]).tolist() == [0, 1, 2, 0, 0, 1]
    assert positions([]).tolist() == []
