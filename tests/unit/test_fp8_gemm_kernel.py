"""The Triton fp8 decode product (:mod:`ember.core.kernels.fp8_gemm`, on the CPU through Triton's
interpreter) against a float64 model of W8A8 with DeepSeek-V3's blocks: per 128-wide K block, the
product of the e4m3 operands times ``scale_inv[n // 128, kb] · xs[m, kb]``, summed over blocks.
Every launch shape (rows and columns per program, K splits, uneven splits, rows that do not fill a
block) gives the model's product within fp32 rounding, and the splits' sums are deterministic."""

import textwrap

import pytest
import torch

from tests.triton_interp import run_interpreted

pytest.importorskip("triton")
if not hasattr(torch, "float8_e4m3fn"):
    pytest.skip("torch without float8_e4m3fn", allow_module_level=True)

SCRIPT = textwrap.dedent(
    """
    import torch
    from tests.triton_interp import patch_interpreter
    patch_interpreter()

    from ember.core import quant
    from ember.core.kernels import fp8_gemm as fg, fp8_quant as fq

    def model(xq, xs, q, s):
        # fp64: the dequantised operands' product (each e4m3 product and its scales are exact in fp64)
        M, K = xq.shape
        xd = (xq.double().reshape(M, K // 128, 128) * xs.double()[..., None]).reshape(M, K)
        return xd @ quant.dequant_fp8_block(q, s).double().t()

    g = torch.Generator().manual_seed(0)
    n = 0
    for M, N, K in ((1, 128, 128), (5, 256, 384), (64, 384, 1024), (70, 128, 640)):
        x = (torch.randn(M, K, generator=g) * torch.exp(torch.randn(M, 1, generator=g))).bfloat16()
        w = torch.randn(N, K, generator=g) * torch.exp(torch.randn(N, 1, generator=g)) * 0.05
        q, s = quant.quantize_fp8_block(w, 128)
        xq, xs = fq.quantize_act_fp8(x)
        ref = model(xq, xs, q, s)
        scale = ref.abs().max()
        default = fg.fp8_linear(xq, xs, q, s, torch.float32)
        cfgs = [None, fg.Config(16, 128, 1), fg.Config(64, 64, 3), fg.Config(16, 32, 8), fg.Config(32, 128, 2)]
        for cfg in cfgs:
            for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 8e-3)):
                y = fg.fp8_linear(xq, xs, q, s, dtype, cfg)
                assert y.shape == (M, N) and y.dtype == dtype, (y.shape, y.dtype)
                err = float((y.double() - ref).abs().max() / scale)
                assert err < tol, (M, N, K, cfg, dtype, err)
                n += 1
            # a split's partial sums are added in split order: the same bits on every call
            again = fg.fp8_linear(xq, xs, q, s, torch.float32, cfg)
            assert torch.equal(again, fg.fp8_linear(xq, xs, q, s, torch.float32, cfg)), cfg
        assert torch.equal(default, fg.fp8_linear(xq, xs, q, s, torch.float32, fg.config(M, N, K, x.device)))

    # strided rows of x (a row slice of a wider batch) and no rows at all
    big = torch.randn(9, 512, generator=g).bfloat16()
    xq, xs = fq.quantize_act_fp8(big)
    q, s = quant.quantize_fp8_block(torch.randn(256, 512, generator=g) * 0.05, 128)
    y = fg.fp8_linear(xq[::2], xs[::2], q, s, torch.float32)
    assert float((y.double() - model(xq[::2], xs[::2], q, s)).abs().max()) < 1e-5
    assert fg.fp8_linear(xq[:0], xs[:0], q, s, torch.bfloat16).shape == (0, 256)
    print("OK", n)
    """
)


def test_fp8_gemm_kernel_matches_f64_model():
    assert "OK" in run_interpreted(SCRIPT, timeout=900)


def test_fp8_gemm_shape_errors():
    from ember.core.kernels import fp8_gemm

    if not fp8_gemm.fused.HAVE_TRITON:
        pytest.skip("no triton")
    xq = torch.zeros(4, 256, dtype=torch.float8_e4m3fn)
    xs = torch.ones(4, 2)
    q = torch.zeros(128, 256, dtype=torch.float8_e4m3fn)
    s = torch.ones(1, 2)
    with pytest.raises(ValueError, match="multiples"):
        fp8_gemm.fp8_linear(xq[:, :200], xs, q[:, :200], s, torch.float32)
    with pytest.raises(ValueError, match="scales"):
        fp8_gemm.fp8_linear(xq, xs[:, :1], q, s, torch.float32)
    with pytest.raises(ValueError, match="unit stride"):
        fp8_gemm.fp8_linear(xq, xs, q.t().contiguous().t(), s, torch.float32)


def test_config_fills_the_gpu_with_few_splits():
    from ember.core.kernels import fp8_gemm

    if not fp8_gemm.fused.HAVE_TRITON:
        pytest.skip("no triton")
    cpu = torch.device("cpu")  # taken as 132 SMs (an H100/H200): 256 programs wanted
    # Qwen3-8B at 64 rows: the best launch shapes of bench/fp8_decode_gemm.py on an H100
    splits = {(24576, 4096): 1, (6144, 4096): 4, (4096, 4096): 4, (4096, 12288): 4, (1024, 4096): 8}
    for (N, K), split in splits.items():
        cfg = fp8_gemm.config(64, N, K, cpu)
        assert (cfg.block_m, cfg.block_n, cfg.split, cfg.warps, cfg.stages) == (64, 64, split, 4, 3), (N, K, cfg)
    small = fp8_gemm.config(3, 1024, 512, cpu)  # four K blocks: never split below four each
    assert small.block_m == 16 and small.split == 1
