"""The grouped LoRA expand-add kernel (ember.core.kernels.grouped_lora, CUDA path) under Triton's
interpreter: ``y[rows of g] += h[rows of g] @ B[g].T`` in place against the float64 product, for
groups that are empty, smaller than a row tile, larger than several, and rows past the last group;
a factor read transposed; and an MoE layer whose corrections and input gradients run through it
against the same layer in float64."""

import textwrap

import pytest

from tests.triton_interp import run_interpreted

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import torch
    from ember.core.kernels import grouped_lora
    from tests.triton_interp import patch_interpreter
    patch_interpreter()
    torch.manual_seed(0)

    def reference(y, h, B, offsets):
        out, start = y.double().clone(), 0
        for g, end in enumerate(offsets.tolist()):
            out[start:end] += h[start:end].double() @ B[g].double().T
            start = end
        return out

    sizes = [0, 3, 64, 1, 1, 2, 150, 0, 40]  # empty groups, many groups in one tile, one over three tiles
    offsets = torch.tensor(sizes).cumsum(0).to(torch.int32)
    N = int(offsets[-1]) + 5  # rows past the last group stay as they are
    for dtype, R, n_out, transposed in ((torch.float32, 5, 300, False), (torch.float32, 32, 130, True),
                                        (torch.bfloat16, 8, 96, False)):
        y = torch.randn(N, n_out).to(dtype)
        h = torch.randn(N, R).to(dtype)
        if transposed:  # a shrink factor [G, r, out] read as [G, out, r]
            B = torch.randn(len(sizes), R, n_out).to(dtype).transpose(1, 2)
        else:
            B = torch.randn(len(sizes), n_out, R).to(dtype)
        assert grouped_lora.available(y, h, B)
        ref = reference(y, h, B, offsets)
        got = grouped_lora.expand_add(y.clone(), h, B, offsets)
        assert got.dtype == dtype
        if dtype == torch.float32:
            err = (got.double() - ref).abs().max().item()
            assert err < 1e-5, (R, n_out, err)
        else:  # rounded once from fp32 (the interpreter truncates): within one bf16 step of the sum
            step = ref.abs().clamp_min(1e-3) * 2**-7
            assert ((got.double() - ref).abs() <= step).all(), (got.double() - ref).abs().max()
        assert torch.equal(got[int(offsets[-1]):], y[int(offsets[-1]):])
    empty = torch.zeros(0, 4)
    assert grouped_lora.expand_add(empty, torch.zeros(0, 2), torch.zeros(3, 4, 2), torch.zeros(3, dtype=torch.int32)).shape == (0, 4)

    # an MoE layer with LoRA on its experts: forward and every gradient against fp64 (same code, no kernel)
    from ember.core.kernels import fused
    from tests.unit.test_moe_offsets import moe_layer_against_fp64
    calls = []
    launch = grouped_lora.expand_add
    grouped_lora.expand_add = lambda *a: calls.append(a[0].shape[1]) or launch(*a)

    def kernels_off():  # the PyTorch path, in fp64
        assert len(calls) == 4, calls  # two corrections forward, two input gradients backward
        fused.use_triton = grouped_lora.available = lambda *t: False

    moe_layer_against_fp64(kernels_off)
    print("ok")
    """
)


def test_grouped_lora_kernel_under_interpreter():
    assert "ok" in run_interpreted(SCRIPT)
