"""The grouped weight gradient over gathered rows (ember.core.kernels.gathered_wgrad, CUDA path)
under Triton's interpreter: ``out[g] = a[rows of g].T @ x[index[rows of g]]`` against the float64
product, for groups that are empty, smaller than a row step and longer than several, rows past the
last group, repeated and unsorted indices, ranks below and above the padded tile; and an MoE layer
whose LoRA shrink factor's gradient runs through it against the same layer in float64."""

import textwrap

import pytest

from tests.triton_interp import run_interpreted

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import torch
    from ember.core.kernels import gathered_wgrad
    from tests.triton_interp import patch_interpreter
    patch_interpreter()
    torch.manual_seed(0)

    def reference(a, x, index, offsets):
        out, start = [], 0
        for end in offsets.tolist():
            out.append(a[start:end].double().T @ x[index[start:end]].double())
            start = end
        return torch.stack(out)

    sizes = [0, 3, 64, 1, 2, 150, 0, 40]  # empty groups (the last is not), one over three row steps
    offsets = torch.tensor(sizes).cumsum(0).to(torch.int32)
    N = int(offsets[-1]) + 7  # rows past the last group are not read
    T = 50
    for dtype, R, H, config in ((torch.float32, 5, 300, None), (torch.float32, 64, 130, None),
                                (torch.bfloat16, 32, 96, None), (torch.float32, 16, 70, (16, 32, 4))):
        a = torch.randn(N, R).to(dtype)
        x = torch.randn(T, H).to(dtype)
        index = torch.randint(0, T, (N,))  # repeats, any order
        a[int(offsets[-1]):] = float("nan")  # would poison a sum that read them
        assert gathered_wgrad.available(a, x)
        ref = reference(a, x, index, offsets)
        got = gathered_wgrad.wgrad_gathered(a, x, index, offsets, config=config)
        assert got.shape == (len(sizes), R, H) and got.dtype == dtype
        assert torch.equal(got[0], torch.zeros(R, H).to(dtype)) and torch.equal(got[6], got[0])
        if dtype == torch.float32:
            err = (got.double() - ref).abs().max().item()
            assert err < 1e-4, (R, H, err)
        else:  # rounded once from fp32 (the interpreter truncates): within one bf16 step of the sum
            step = ref.abs().clamp_min(1e-2) * 2**-7
            assert ((got.double() - ref).abs() <= step).all(), (got.double() - ref).abs().max()
        out32 = gathered_wgrad.wgrad_gathered(a, x, index, offsets, out_dtype=torch.float32)
        assert out32.dtype == torch.float32
    assert not gathered_wgrad.available(torch.zeros(4, 2, dtype=torch.float64), torch.zeros(3, 8, dtype=torch.float64))
    assert not gathered_wgrad.available(torch.zeros(4, 2), torch.zeros(3, 8, dtype=torch.bfloat16))

    # an MoE layer with LoRA on its experts: forward and every gradient against fp64 (same code, no kernel)
    from ember.core.kernels import fused, grouped_lora
    from tests.unit.test_moe_offsets import moe_layer_against_fp64
    calls = []
    launch = gathered_wgrad.wgrad_gathered
    gathered_wgrad.wgrad_gathered = lambda *a: calls.append(a[0].shape) or launch(*a)

    def kernels_off():  # the PyTorch path, in fp64
        assert len(calls) == 1, calls  # the gate/up shrink factor's gradient (down's input is not gathered)
        fused.use_triton = grouped_lora.available = lambda *t: False

    moe_layer_against_fp64(kernels_off)
    print("ok")
    """
)


def test_gathered_wgrad_kernel_under_interpreter():
    assert "ok" in run_interpreted(SCRIPT)
