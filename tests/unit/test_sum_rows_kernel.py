"""The MoE combine kernel (ember.core.kernels.sum_rows, CUDA path) under Triton's interpreter: each
token's sum of its k rows of one tensor or of two, bitwise the fp32 sum in the kernel's order,
rounded once; and an MoE layer whose combine and input gradient run through it against the same
layer in fp64."""

import textwrap

import pytest

from tests.triton_interp import run_interpreted

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import torch
    from ember.core.kernels import sum_rows as kernels
    from ember.core.layers import moe
    from tests.triton_interp import patch_interpreter
    patch_interpreter()
    torch.manual_seed(0)

    # widths below and above one column block (1024), k of 1 and 8
    for T, k, H, dtype in ((5, 8, 48, torch.bfloat16), (3, 1, 1100, torch.float32), (4, 3, 20, torch.bfloat16)):
        n = T * k
        a, b = torch.randn(n, H).to(dtype), torch.randn(n, H).to(dtype)
        inverse = torch.randperm(n)
        for extra in (None, b):
            for out_dtype in (dtype, torch.float32):
                got = kernels.sum_rows(a, inverse, T, out_dtype, extra)
                acc = torch.zeros(T, H)
                for j in range(k):
                    rows = inverse.view(T, k)[:, j]
                    acc = acc + a[rows].float()
                    if extra is not None:
                        acc = acc + extra[rows].float()
                assert got.dtype == out_dtype
                # rounded once (to nearest on the GPU; Triton's interpreter truncates to bf16)
                truncated = (acc.view(torch.int32) & ~0xFFFF).view(torch.float32).to(out_dtype)
                assert torch.equal(got, acc.to(out_dtype)) or (out_dtype == torch.bfloat16 and torch.equal(got, truncated)), \
                    (T, k, H, dtype, extra is None, out_dtype)
    assert kernels.sum_rows(a, inverse[:0], 0, torch.float32).shape == (0, 20)

    # an MoE layer with LoRA on its experts: forward and every gradient against fp64 (same code, no kernel)
    from ember.core.kernels import fused, grouped_lora
    from tests.unit.test_moe_offsets import moe_layer_against_fp64
    calls = []
    launch = kernels.sum_rows
    kernels.sum_rows = lambda *a: calls.append(a[4] is not None) or launch(*a)
    grouped_lora.available = lambda *t: False  # the corrections apart, for the combine to sum

    def kernels_off():  # the PyTorch path, in fp64
        assert calls == [True, True], calls  # the combine and the input's gradient, each with the LoRA rows
        fused.use_triton = kernels.available = lambda *t: False

    moe_layer_against_fp64(kernels_off)
    print("ok")
    """
)


def test_sum_rows_kernel_under_the_interpreter():
    assert run_interpreted(SCRIPT, timeout=600).strip().endswith("ok")
