"""The sampler's fused q/k norm + rotation (``fused.qk_norm_rope``, on the CPU through Triton's
interpreter) gives the values of the separate kernels it replaces (``RMSNormFn`` then ``RopeFn``):
strided heads of a packed projection, plain and zero-centred norms, full and partial rotation, the
rotation alone; and ``rope.norm_rope`` takes it only in passes without gradients."""

import textwrap

import pytest
import torch

from tests.triton_interp import run_interpreted

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import torch
    from tests.triton_interp import patch_interpreter
    patch_interpreter()

    from ember.core.config import RopeConfig
    from ember.core.kernels import fused
    from ember.core.layers import rope
    from ember.core.layers.norms import RMSNorm

    g = torch.Generator().manual_seed(0)
    n = 0
    for zero_centred, partial, T, Hq, Hk, D in ((False, 1.0, 5, 4, 2, 64), (True, 0.25, 3, 6, 2, 64),
                                                (False, 0.5, 4, 3, 1, 32)):
        # q, k, v side by side, as the packed projection gives them: strided heads
        packed = (torch.randn(T, (Hq + 2 * Hk) * D, generator=g) * 3).bfloat16()
        q = packed[:, : Hq * D].view(T, Hq, D)
        k = packed[:, Hq * D : (Hq + Hk) * D].view(T, Hk, D)
        qn, kn = RMSNorm(D, 1e-6, zero_centred), RMSNorm(D, 1e-5, zero_centred)
        with torch.no_grad():
            qn.weight.copy_(torch.randn(D, generator=g) * 0.3 + (0 if zero_centred else 1))
            kn.weight.copy_(torch.randn(D, generator=g) * 0.3 + (0 if zero_centred else 1))
        qn, kn = qn.bfloat16(), kn.bfloat16()
        rotary = rope.RotaryEmbedding(RopeConfig(theta=10000.0, partial_rotary_factor=partial), D)
        cos, sin = rotary.cos_sin(torch.arange(T) * 7, torch.bfloat16)
        with torch.no_grad():
            ref_q = fused.RopeFn.apply(fused.RMSNormFn.apply(q, qn.weight, qn.eps, zero_centred), cos, sin)
            ref_k = fused.RopeFn.apply(fused.RMSNormFn.apply(k, kn.weight, kn.eps, zero_centred), cos, sin)
            got_q, got_k = fused.qk_norm_rope(q, k, qn.weight, kn.weight, qn.eps, kn.eps, zero_centred, cos, sin)
            assert torch.equal(got_q, ref_q) and torch.equal(got_k, ref_k), (zero_centred, partial)
            # the layer's helper takes the kernel without gradients, and gives the same
            calls = []
            real = fused.qk_norm_rope
            fused.qk_norm_rope = lambda *a: calls.append(1) or real(*a)
            hq, hk = rope.norm_rope(q, k, qn, kn, cos, sin)
            fused.qk_norm_rope = real
            assert calls and torch.equal(hq, ref_q) and torch.equal(hk, ref_k)
            # the rotation alone (no q/k norms: Llama)
            aq, ak = rope.norm_rope(q, k, None, None, cos, sin)
            assert torch.equal(aq, fused.RopeFn.apply(q, cos, sin)) and torch.equal(ak, fused.RopeFn.apply(k, cos, sin))
        # with gradients: the separate autograd functions (training), same values
        tq, tk = rope.norm_rope(q.clone().requires_grad_(), k, qn, kn, cos, sin)
        assert tq.grad_fn is not None and torch.equal(tq.detach(), ref_q) and torch.equal(tk.detach(), ref_k)
        n += 1
    print("OK", n)
    """
)


def test_qk_norm_rope_kernel_equals_the_separate_kernels():
    assert "OK 3" in run_interpreted(SCRIPT, timeout=600)


def test_norm_rope_on_the_cpu_is_the_reference():
    """Without Triton's interpreter the CPU runs the PyTorch norm and rotation."""
    from ember.core.config import RopeConfig
    from ember.core.kernels import fused
    from ember.core.layers import rope
    from ember.core.layers.norms import RMSNorm

    if fused.use_triton(torch.zeros(1)):
        pytest.skip("the interpreter is on: covered above")
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(3, 4, 16, generator=g), torch.randn(3, 2, 16, generator=g)
    qn, kn = RMSNorm(16), RMSNorm(16)
    cos, sin = rope.RotaryEmbedding(RopeConfig(theta=1e4), 16).cos_sin(torch.arange(3), torch.float32)
    with torch.no_grad():
        got_q, got_k = rope.norm_rope(q, k, qn, kn, cos, sin)
    torch.testing.assert_close(got_q, rope.apply_rope(qn(q), cos, sin))
    torch.testing.assert_close(got_k, rope.apply_rope(kn(k), cos, sin))
