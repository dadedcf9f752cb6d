"""The key heads' norm and repetition for fla (ember.core.kernels.l2norm_heads, CUDA path) under
Triton's interpreter: values and input gradients against the float64 formula (normalise, repeat
each head r times in repeat_interleave's order), from strided views, in fp32 and bf16."""

import textwrap

import pytest
import torch

from ember.core.kernels.l2norm_heads import l2norm_repeat
from tests.triton_interp import run_interpreted

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import torch
    from ember.core.kernels import l2norm_heads
    from tests.triton_interp import patch_interpreter
    patch_interpreter()
    torch.manual_seed(0)

    def reference(x, r, dy):
        x64 = x.detach().double().requires_grad_()
        y = x64 * torch.rsqrt((x64 * x64).sum(-1, keepdim=True) + 1e-6)
        y = y.repeat_interleave(r, dim=1)
        (dx,) = torch.autograd.grad(y, x64, dy.double())
        return y.detach(), dx

    # a width below a power of two, rows not a multiple of the row block, the q columns of a
    # wider per-head block (GDN's [q | k | v] layout); r = 1, 2 and 3
    for T, H, D, r in ((37, 3, 48, 2), (5, 16, 128, 2), (9, 2, 64, 1), (4, 5, 32, 3)):
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 8e-3)):
            wide = torch.randn(T, H, 3 * D).to(dtype)
            x = wide[..., D:2 * D].requires_grad_()
            dy = torch.randn(T, H * r, D).to(dtype)
            y = l2norm_heads._L2NormRepeat.apply(x, r, 1e-6, (2048, 4) if D == 48 else None)
            (dx,) = torch.autograd.grad(y, x, dy)
            ref_y, ref_dx = reference(x, r, dy)
            assert y.shape == (T, H * r, D) and y.dtype == dtype and y.is_contiguous()
            assert dx.shape == x.shape and dx.dtype == dtype
            # the r copies of a head are the same values, in repeat_interleave's order
            copies = y.detach().view(T, H, r, D)
            assert all(torch.equal(copies[:, :, j], copies[:, :, 0]) for j in range(r))
            err_y = float((y.double() - ref_y).abs().max())
            err_dx = float((dx.double() - ref_dx).abs().max() / ref_dx.abs().max())
            assert err_y < tol, (T, H, D, r, dtype, err_y)
            assert err_dx < tol, (T, H, D, r, dtype, err_dx)
    # an empty batch
    x = torch.zeros(0, 4, 16, requires_grad=True)
    y = l2norm_heads._L2NormRepeat.apply(x, 2, 1e-6, None)
    assert y.shape == (0, 8, 16)
    y.sum().backward()
    assert x.grad.shape == (0, 4, 16)
    print("ok")
    """
)


def test_the_kernel_against_the_float64_formula():
    assert run_interpreted(SCRIPT).strip().endswith("ok")


def test_the_torch_form_normalises_once_and_repeats_in_order():
    torch.manual_seed(0)
    x = torch.randn(6, 3, 8, dtype=torch.float64, requires_grad=True)
    y = l2norm_repeat(x, 2)
    ref = x / (x.pow(2).sum(-1, keepdim=True) + 1e-6).sqrt()
    assert torch.allclose(y, ref.repeat_interleave(2, dim=1), atol=1e-12)
    assert torch.equal(y[:, 2], y[:, 3]) and torch.allclose(y[:, 2], ref[:, 1], atol=1e-12)
    bf = l2norm_repeat(x.detach().bfloat16(), 1)
    assert bf.dtype == torch.bfloat16 and torch.allclose(bf.double(), ref.detach(), atol=8e-3)
    with pytest.raises(ValueError, match=r"takes \[T, H, D\] heads"):
        l2norm_repeat(x[0], 2)
