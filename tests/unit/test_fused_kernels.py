"""The Triton kernels equal the PyTorch formulas (run on the CPU through Triton's interpreter)."""

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import torch
    from ember.core.kernels import fused
    from ember.core.layers import norms, activations, rope
    assert fused.use_triton(torch.zeros(1))
    torch.manual_seed(0)

    def check(name, got, ref, tol):
        err = (got.double() - ref.double()).abs().max().item()
        assert err <= tol, (name, err)
        print(name, err)

    for zero_centred, fp32_product in ((False, False), (True, False), (False, True)):
        for need_dw in (False, True):
            x = torch.randn(37, 3, 48, dtype=torch.float64).float().requires_grad_()
            w = (torch.randn(48) * 0.1 + (0 if zero_centred else 1)).requires_grad_(need_dw)
            g = torch.randn(37, 3, 48)
            y = fused.RMSNormFn.apply(x, w, 1e-6, zero_centred, fp32_product)
            (y * g).sum().backward()
            gx, gw = x.grad.clone(), (w.grad.clone() if need_dw else None)
            x.grad = None; w.grad = None
            yr = norms._RMSNorm.apply(x, w, 1e-6, zero_centred, fp32_product)
            (yr * g).sum().backward()
            mode = f"zc={zero_centred} fp32={fp32_product}"
            check(f"rmsnorm {mode} y", y, yr, 1e-5)
            check(f"rmsnorm {mode} dx", gx, x.grad, 1e-4)
            if need_dw:
                check(f"rmsnorm {mode} dw", gw, w.grad, 1e-4)

    # the residual add and the norm in one kernel (no gradient): the sum, rounded to the input dtype,
    # then the norm kernel's values bit for bit, in fp32 and bf16, and the torch formula. (The
    # interpreter rounds fp32 to bf16 toward zero where the GPU rounds to nearest even, as torch's
    # add does: here the bf16 sum may be one unit in the last place off; gpu_checks.py add_norm
    # holds it equal on the GPU.)
    with torch.no_grad():
        for dtype in (torch.float32, torch.bfloat16):
            for zero_centred, fp32_product in ((False, False), (True, False), (False, True)):
                x = torch.randn(37, 3, 48).to(dtype)
                r = torch.randn(37, 3, 48).to(dtype)
                w = (torch.randn(48) * 0.1 + (0 if zero_centred else 1)).to(dtype)
                s, y = norms.add_rms_norm(x, r, w, 1e-6, zero_centred, fp32_product)
                ulp = 0.0 if dtype == torch.float32 else 2.0 ** -7
                assert s.dtype == x.dtype
                assert ((s.float() - (x + r).float()).abs() <= ulp * (x + r).float().abs()).all()
                assert torch.equal(y, fused.RMSNormFn.apply(s, w, 1e-6, zero_centred, fp32_product))
                yr = norms._RMSNorm.apply(s, w, 1e-6, zero_centred, fp32_product)
                rel = ((y.float() - yr.float()).abs() / yr.float().abs().clamp_min(1e-3)).max().item()
                assert rel <= (1e-5 if dtype == torch.float32 else 2.0 ** -6), (dtype, rel)
    x = torch.randn(5, 48, requires_grad=True)  # with gradients: the add, then the autograd norm
    s, y = norms.add_rms_norm(x, torch.randn(5, 48), torch.ones(48), 1e-6)
    assert s.grad_fn is not None and y.grad_fn is not None

    gu = torch.randn(29, 2 * 70).requires_grad_()
    gate, up = gu[:, :70], gu[:, 70:]   # strided views, as in the MoE path
    g = torch.randn(29, 70)
    y = fused.SiluMulFn.apply(gate, up)
    (y * g).sum().backward()
    got = gu.grad.clone(); gu.grad = None
    yr = activations._SiluMul.apply(gate, up)
    (yr * g).sum().backward()
    check("silu_mul y", y, yr, 1e-5)
    check("silu_mul grad", got, gu.grad, 1e-5)

    # with a row scale (an MoE layer's routing weights): the kernel (one and three column blocks
    # per row, so the scale's gradient sums partials) and the torch path against fp64 autograd
    for width in (70, 2500):
        gu = torch.randn(13, 2 * width, dtype=torch.float64)
        sc = torch.rand(13, dtype=torch.float64)
        g = torch.randn(13, width, dtype=torch.float64)
        ref_in = [gu.clone().requires_grad_(), sc.clone().requires_grad_()]
        gate, up = ref_in[0][:, :width], ref_in[0][:, width:]
        ((torch.nn.functional.silu(gate) * up * ref_in[1][:, None]) * g).sum().backward()
        for name, fn in (("kernel", fused.SiluMulFn.apply), ("torch", activations._SiluMul.apply)):
            x = [gu.float().requires_grad_(), sc.float().requires_grad_()]
            y = fn(x[0][:, :width], x[0][:, width:], x[1])
            (y * g.float()).sum().backward()
            yr = torch.nn.functional.silu(gu[:, :width]) * gu[:, width:] * sc[:, None]
            check(f"silu_mul scaled {name} {width} y", y, yr, 1e-5)
            check(f"silu_mul scaled {name} {width} dgate/dup", x[0].grad, ref_in[0].grad, 1e-5)
            check(f"silu_mul scaled {name} {width} dscale", x[1].grad, ref_in[1].grad, 1e-3)

    # packed gate_up (an expert block's product): one gradient tensor, both halves from the kernel
    for width, scaled in ((70, True), (2500, True), (70, False)):
        gu = torch.randn(13, 2 * width, dtype=torch.float64)
        sc = torch.rand(13, dtype=torch.float64)
        g = torch.randn(13, width, dtype=torch.float64)
        ref_in = [gu.clone().requires_grad_(), sc.clone().requires_grad_()]
        yr = torch.nn.functional.silu(ref_in[0][:, :width]) * ref_in[0][:, width:]
        if scaled:
            yr = yr * ref_in[1][:, None]
        (yr * g).sum().backward()
        for name, fn in (("kernel", fused.SiluMulPackedFn.apply), ("torch", activations._SiluMulPacked.apply)):
            x = [gu.float().requires_grad_(), sc.float().requires_grad_()]
            y = fn(x[0], x[1] if scaled else None)
            (y * g.float()).sum().backward()
            check(f"silu_mul packed {name} {width} {scaled} y", y, yr, 1e-5)
            check(f"silu_mul packed {name} {width} {scaled} dgate_up", x[0].grad, ref_in[0].grad, 1e-5)
            if scaled:
                check(f"silu_mul packed {name} {width} dscale", x[1].grad, ref_in[1].grad, 1e-3)

    for rot in (32, 16):   # full and partial rotary
        x = torch.randn(11, 4, 32).requires_grad_()
        pos = torch.arange(11)
        inv = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
        emb = torch.cat([pos[:, None] * inv, pos[:, None] * inv], -1)
        cos, sin = emb.cos(), emb.sin()
        g = torch.randn(11, 4, 32)
        y = fused.RopeFn.apply(x, cos, sin)
        (y * g).sum().backward()
        got = x.grad.clone(); x.grad = None
        cs, sn = cos[:, None], sin[:, None]
        if rot == 32:
            yr = x * cs + rope.rotate_half(x) * sn
        else:
            r = x[..., :rot]
            yr = torch.cat([r * cs + rope.rotate_half(r) * sn, x[..., rot:]], -1)
        (yr * g).sum().backward()
        check(f"rope {rot} y", y, yr, 1e-5)
        check(f"rope {rot} grad", got, x.grad, 1e-5)
    from ember.core import logprobs
    for cap in (None, 7.0):
        for inv_t in (None, torch.tensor([1.0, 0.5, 2.0, 1.25, 1.0, 3.0, 0.7, 1.0, 1.1])):
            z = torch.randn(9, 5000) * 4
            lse = fused.row_logsumexp(z, cap, inv_t)
            zc = z if cap is None else cap * torch.tanh(z / cap)
            zt = zc if inv_t is None else zc * inv_t[:, None]
            check(f"row_logsumexp cap={cap} t={inv_t is not None}", lse, torch.logsumexp(zt, -1), 1e-4)
            sc = torch.randn(9)
            got = fused.scaled_softmax(z, lse, sc, cap, torch.float32, inv_t)
            ref = torch.exp(zt - lse[:, None]) * sc[:, None]
            if cap is not None:
                ref = ref * (1 - torch.tanh(z / cap) ** 2)
            check(f"scaled_softmax cap={cap} t={inv_t is not None}", got, ref, 1e-5)

    # the gated norm (Qwen3-Next): kernel and torch path against fp64 autograd of the formula,
    # silu and sigmoid gates, a head width below a power of two, the weight's gradient too
    for sigmoid in (False, True):
        x0, z0 = torch.randn(23, 3, 40, dtype=torch.float64), torch.randn(23, 3, 40, dtype=torch.float64)
        w0 = torch.rand(40, dtype=torch.float64) + 0.5
        dy = torch.randn(23, 3, 40, dtype=torch.float64)
        ref = [t.clone().requires_grad_() for t in (x0, z0, w0)]
        xr, zr, wr = ref
        act = torch.sigmoid(zr) if sigmoid else torch.nn.functional.silu(zr)
        yr = wr * xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + 1e-6) * act
        (yr * dy).sum().backward()
        for name, fn in (("kernel", fused.GatedRMSNormFn.apply), ("torch", norms._GatedRMSNorm.apply)):
            got = [t.float().requires_grad_() for t in (x0, z0, w0)]
            y = fn(*got, 1e-6, sigmoid)
            (y * dy.float()).sum().backward()
            check(f"gated norm {name} sigmoid={sigmoid} y", y, yr, 1e-5)
            for part, a, b in zip(("dx", "dgate", "dw"), got, ref):
                check(f"gated norm {name} sigmoid={sigmoid} {part}", a.grad, b.grad, 1e-4)
    print("OK")
    """
)


def test_triton_kernels_match_torch_reference():
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600, check=False)
    assert out.returncode == 0 and "OK" in out.stdout, out.stdout + out.stderr


def test_the_fp32_product_norm_is_olmos_order():
    """``fp32_product`` (Olmo3's norms): ``(w * x̂).to(dtype)`` with the product in fp32, which in
    bf16 differs from the Llama order ``w * x̂.to(dtype)``; its gradients are the same formula."""
    import torch

    from ember.core.layers import norms

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 96, generator=g).bfloat16().requires_grad_()
    w = (torch.rand(96, generator=g) + 0.5).bfloat16().requires_grad_()
    y = norms.rms_norm(x, w, 1e-6, fp32_product=True)
    xf = x.detach().float()
    olmo = (w.detach().float() * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6))).bfloat16()
    assert torch.equal(y, olmo)
    assert not torch.equal(y, norms.rms_norm(x, w, 1e-6))  # bf16 tells the two orders apart
    dy = torch.randn(64, 96, generator=g).bfloat16()
    (y.float() * dy.float()).sum().backward()
    xd, wd = xf.double().requires_grad_(), w.detach().double().requires_grad_()
    ref = wd * xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6)
    (ref * dy.double()).sum().backward()
    assert (x.grad.double() - xd.grad).norm() / xd.grad.norm() < 1e-2
    assert (w.grad.double() - wd.grad).norm() / wd.grad.norm() < 1e-2
