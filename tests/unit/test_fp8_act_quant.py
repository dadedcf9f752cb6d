"""The Triton fp8 activation quantiser (:mod:`ember.core.kernels.fp8_quant`, run on the CPU through
Triton's interpreter) returns bit for bit what the PyTorch ``rollout_precision._quantize_act_torch``
returns (e4m3 bytes and fp32 scales), and both equal a float64 model of the format: per 1 × 128
block ``scale = fp32(amax / 448)`` (at least fp32(1e-12)), ``x / scale`` (IEEE fp32 division)
rounded to the nearest e4m3 value, ties to the even code, saturating at ±448, the sign of zero kept."""

import textwrap

import pytest
import torch

from tests.triton_interp import run_interpreted

pytest.importorskip("triton")
if not hasattr(torch, "float8_e4m3fn"):
    pytest.skip("torch without float8_e4m3fn", allow_module_level=True)

SCRIPT = textwrap.dedent(
    """
    import numpy as np
    import torch
    from tests.triton_interp import patch_interpreter
    patch_interpreter()

    from ember.core import rollout_precision as rp
    from ember.core.kernels import fp8_quant as fq
    assert fq.available(torch.zeros(1))

    # -- float64 model of e4m3fn: code i (0..126) is GRID[i], increasing ----------------------------
    GRID = np.array([m * 2.0**-9 for m in range(8)]
                    + [(1 + m / 8) * 2.0 ** (e - 7) for e in range(1, 16) for m in range(8)][:-1])
    assert len(GRID) == 127 and GRID[-1] == 448.0 and np.all(np.diff(GRID) > 0)

    def e4m3_bytes(v):
        # nearest code, ties to the even code (= even mantissa), saturating at 448; sign bit kept
        mag = np.minimum(np.abs(v), 448.0)
        hi = np.clip(np.searchsorted(GRID, mag), 1, 126)  # GRID[hi-1] < mag <= GRID[hi] (or mag = 0)
        d_lo, d_hi = mag - GRID[hi - 1], GRID[hi] - mag
        code = np.where((d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0)), hi, hi - 1)
        return (code + np.where(np.signbit(v), 128, 0)).astype(np.uint8)

    def reference(x):
        x64 = x.double().numpy()
        M, K = x64.shape
        blocks = x64.reshape(M, K // 128, 128)
        amax = np.abs(blocks).max(-1)
        # amax / 448 correctly rounded to fp32 (f64 then f32 rounding is innocuous for a quotient)
        scale = np.maximum((amax / 448.0).astype(np.float32), np.float32(1e-12))
        v = (blocks / scale.astype(np.float64)[..., None]).astype(np.float32).astype(np.float64)
        return e4m3_bytes(v).reshape(M, K), scale

    def check(x, what):
        q, s = fq.quantize_act_fp8(x)
        rq, rs = rp._quantize_act_torch(x)
        assert q.dtype == rq.dtype == torch.float8_e4m3fn and q.shape == rq.shape == x.shape, what
        assert s.dtype == rs.dtype == torch.float32 and s.shape == rs.shape, what
        assert s.stride() == rs.stride() == (x.shape[1] // 128, 1), (what, s.stride())
        qb, rqb = q.view(torch.uint8), rq.view(torch.uint8)
        bad = (qb != rqb).nonzero()
        assert len(bad) == 0, (what, "bytes differ", bad[:5].tolist(), x[tuple(bad[0])].item())
        assert torch.equal(s.view(torch.int32), rs.view(torch.int32)), (what, "scales differ")
        fq_bytes, f_scale = reference(x)
        assert np.array_equal(rs.numpy().view(np.int32), f_scale.view(np.int32)), (what, "scale vs f64 model")
        mism = np.argwhere(rqb.numpy() != fq_bytes)
        assert len(mism) == 0, (what, "bytes vs f64 model", mism[:5].tolist())
        # the outer-dim-major scale layout scaled_mm takes: the same values, strides (1, M)
        q2, s2 = fq.quantize_act_fp8(x, outer_major_scales=True)
        assert torch.equal(q2.view(torch.uint8), qb) and torch.equal(s2, rs), what
        assert s2.stride() == (1, x.shape[0]) and s2.t().is_contiguous(), (what, s2.stride())
        # the dispatcher on the CPU is the PyTorch version, in both layouts
        d_q, d_s = rp._quantize_act(x, outer_major_scales=True)
        assert torch.equal(d_q.view(torch.uint8), rqb) and torch.equal(d_s, rs) and d_s.t().is_contiguous()
        return qb

    g = torch.Generator().manual_seed(0)
    HUGE = {torch.float32: 3.0e38, torch.bfloat16: 3.0e38, torch.float16: 65504.0}
    TINY = {torch.float32: 1e-41, torch.bfloat16: 1e-39, torch.float16: 6e-8}  # subnormals of each
    n = 0
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for M in (1, 3, 64, 130):
            for K in (128, 512, 4096):
                x = torch.randn(M, K, generator=g) * torch.exp(torch.randn(M, 1, generator=g) * 3)
                x = x.to(dtype)
                if M > 1:
                    x[1] = 0  # a row of zeros: scale 1e-12, bytes 0
                    x[1, :128] = -0.0  # negative zeros keep their sign (0x80)
                if M > 2:
                    x[2, :64] = HUGE[dtype] * torch.sign(torch.randn(64, generator=g))  # amax at the top
                    x[2, 64:] = torch.randn(K - 64, generator=g).to(dtype) * 1e-3
                    x[0, -128:] = (torch.randn(128, generator=g) * 1e-6).to(dtype)  # scale below 1e-12 * 448
                    x[0, -128:-120] = TINY[dtype]
                    if K > 128:
                        # huge next to tiny in one block: the tiny ones round to (signed) zero
                        x[0, 128:256] = -TINY[dtype]
                        x[0, 130] = HUGE[dtype]
                qb = check(x, (dtype, M, K))
                if M > 1:
                    assert bool((qb[1, :128] == 128).all()) and bool((qb[1, 128:] == 0).all())
                n += 1

    # ties: a block whose amax is 448 (scale exactly 1) holding values halfway between e4m3 codes
    ties = torch.tensor([448.0, 1.0625, 1.1875, 1.9375, 2.0**-10, 3 * 2.0**-10, 15 * 2.0**-10,
                         -1.0625, -(2.0**-10), 432.0, 0.0, -0.0, 2.0**-6, 7 * 2.0**-9, 240.0, 248.0])
    want = torch.tensor([448.0, 1.0, 1.25, 2.0, 0.0, 2.0**-8, 2.0**-6,
                         -1.0, -0.0, 448.0, 0.0, -0.0, 2.0**-6, 7 * 2.0**-9, 240.0, 256.0])
    x = torch.zeros(2, 128)
    x[0, : len(ties)] = ties
    x[1] = torch.linspace(-448, 448, 128)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        xd = x.to(dtype)
        qb = check(xd, ("ties", dtype))
        got = qb[0, : len(ties)].view(torch.float8_e4m3fn).float()
        assert torch.equal(got, want) and torch.equal(torch.signbit(got), torch.signbit(want)), (dtype, got)

    # every e4m3 value times a block scale comes back as itself (the whole grid, both signs)
    codes = torch.arange(256, dtype=torch.int32)
    codes = codes[(codes & 0x7F) != 0x7F].to(torch.uint8)  # drop the NaNs
    vals = codes.view(torch.float8_e4m3fn).float()
    grid_x = torch.cat([vals, torch.zeros(256 - len(vals))]).reshape(2, 128)
    grid_x[:, 0] = 448.0
    qb = check(grid_x, "grid").flatten()
    keep = torch.ones(len(vals), dtype=torch.bool)
    keep[[0, 128]] = False  # the two places holding the 448 that sets the scale to 1
    assert torch.equal(qb[: len(vals)][keep], codes[keep])

    # NaN and inf as in PyTorch: a NaN block is NaN (scale and bytes); an inf block has an inf
    # scale, signed zeros and a NaN at the inf (NaN bytes compared without their sign bit, which
    # comes from the processor's default NaN)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = torch.randn(4, 256, generator=g)
        x[0, 5], x[1, 3], x[2, 7], x[3, 200] = float("nan"), float("inf"), -float("inf"), float("nan")
        x = x.to(dtype)
        q, s = fq.quantize_act_fp8(x)
        rq, rs = rp._quantize_act_torch(x)
        assert torch.equal(s.isnan(), rs.isnan()) and torch.equal(s.nan_to_num(), rs.nan_to_num()), (dtype, s, rs)
        assert s[0, 0].isnan() and s[1, 0].isinf() and s[2, 0].isinf() and s[3, 1].isnan()
        qb, rqb = q.view(torch.uint8), rq.view(torch.uint8)
        nan = (rqb & 0x7F) == 0x7F
        assert torch.equal((qb & 0x7F) == 0x7F, nan) and torch.equal(qb[~nan], rqb[~nan]), dtype
        assert bool(nan[0, :128].all()) and bool(nan[3, 128:].all()) and int(nan.sum()) == 128 + 128 + 2

    # a row-sliced (strided) input
    big = torch.randn(9, 1024, generator=g).to(torch.bfloat16)
    check(big[::2, 256:768], "strided rows")
    print("OK", n)
    """
)


def test_triton_fp8_act_quant_matches_torch_and_f64_model():
    assert "OK" in run_interpreted(SCRIPT, timeout=900)


def test_quantize_act_shape_errors():
    from ember.core.kernels import fp8_quant

    if not fp8_quant.fused.HAVE_TRITON:
        pytest.skip("no triton")
    with pytest.raises(ValueError):
        fp8_quant.quantize_act_fp8(torch.zeros(2, 100))
    with pytest.raises(ValueError):
        fp8_quant.quantize_act_fp8(torch.zeros(2, 128, dtype=torch.float64))
