"""The decode-shaped expert kernel (:mod:`ember.core.kernels.expert_decode`, on the CPU through
Triton's interpreter): bf16 weights against ``grouped_linear`` of the gathered rows, e4m3 weights
against a float64 model of W8A8 with DeepSeek-V3's blocks; rows gathered in the kernel or not,
experts with no rows and with more rows than one tile; and an MoE layer's output under
``no_grad`` (the sampler's passes, which take the kernel) against the same layer with gradients
on (grouped products)."""

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
    from ember.core.kernels import expert_decode as ed, fp8_quant as fq
    from ember.core.kernels.grouped import grouped_linear
    from ember.core.layers.moe import Experts, ExpertRows, Routing

    g = torch.Generator().manual_seed(0)

    def case(T, E, k, N, K, crowd=False):
        x = torch.randn(T, K, generator=g) * torch.exp(torch.randn(T, 1, generator=g))
        choice = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
        if crowd:
            choice[:, 0] = 1  # every token on expert 1: more rows than one tile
        flat = choice.flatten()
        flat = torch.where(flat == 2, 3, flat)  # expert 2 gets no rows
        order = torch.sort(flat, stable=True).indices
        rows = order // k
        offsets = torch.cumsum(torch.bincount(flat, minlength=E), 0).to(torch.int32)
        return x, rows, offsets

    n = 0
    for T, E, k, N, K, crowd in ((5, 4, 2, 128, 128, False), (12, 6, 3, 256, 384, False), (40, 4, 2, 128, 256, True)):
        x, rows, offsets = case(T, E, k, N, K, crowd)
        # bf16 weights and input, fp32 accumulation and output (the interpreter truncates where
        # a GPU rounds to bf16, so the test reads and writes what needs no rounding)
        w = (torch.randn(E, N, K, generator=g) * K**-0.5).bfloat16()
        xb = x.bfloat16()
        ref = grouped_linear(xb.float()[rows], w.float(), offsets)
        y = ed.expert_linear(xb, rows, w, offsets, out_dtype=torch.float32)
        assert y.shape == ref.shape and y.dtype == torch.float32
        err = float((y - ref).abs().max() / ref.abs().max())
        assert err < 1e-5, ("bf16", T, E, err)
        assert torch.equal(ed.expert_linear(xb[rows].contiguous(), None, w, offsets, out_dtype=torch.float32), y)
        if K % 128 == 0 and N % 128 == 0:
            # e4m3 weights and 1 x 128 activation blocks: the fp64 product of the dequantised operands
            q, s = quant.quantize_fp8_block(w.float(), 128)
            xq, xs = fq.quantize_act_fp8(x)
            xd = (xq.double().reshape(T, K // 128, 128) * xs.double()[..., None]).reshape(T, K)
            ref8 = grouped_linear(xd[rows], quant.dequant_fp8_block(q, s).double(), offsets)
            y8 = ed.expert_linear(x, rows, q, offsets, s)  # x fp32: fp32 output
            err = float((y8.double() - ref8).abs().max() / ref8.abs().max())
            assert err < 1e-6, ("fp8", T, E, err)
        n += 1

    # a K that is not a multiple of 128 (bf16 only): 64-wide K blocks with a masked tail
    x, rows, offsets = case(7, 4, 2, 64, 96)
    w = torch.randn(4, 64, 96, generator=g).bfloat16()
    ref = grouped_linear(x.bfloat16().float()[rows], w.float(), offsets)
    y = ed.expert_linear(x.bfloat16(), rows, w, offsets, out_dtype=torch.float32)
    assert float((y - ref).abs().max() / ref.abs().max()) < 1e-5

    # an MoE layer: under no_grad (the sampler) the kernel runs; with gradients, grouped products
    T, H, I, E, kk = 9, 128, 128, 4, 2
    experts = Experts(H, I, E).to(torch.bfloat16)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(E, 2 * I, H, generator=g) * H**-0.5)
        experts.down_proj.copy_(torch.randn(E, H, I, generator=g) * I**-0.5)
    xin = torch.randn(T, H, generator=g).bfloat16()
    routing = Routing(torch.stack([torch.randperm(E, generator=g)[:kk] for _ in range(T)]),
                      torch.rand(T, kk, generator=g).bfloat16())
    calls = []
    real = ed.expert_linear
    ed.expert_linear = lambda *a, **kw: calls.append(1) or real(*a, **kw)
    with torch.no_grad():
        fast = experts(xin, routing, None)
    assert len(calls) == 2, calls  # gate_up and down
    ref = experts(xin.requires_grad_(), routing, None).detach()
    assert len(calls) == 2
    assert float((fast.float() - ref.float()).abs().max() / ref.float().abs().max()) < 2e-2

    # the LoRA term in the same pass: pairs (expert, group), rows of several groups in one expert
    # and in one tile, ranks below and above 16 (the epilogue's smallest rank block), against fp64
    # (the first case crowds one expert: 64-row tiles whose rows span all three groups)
    # (fdt: the factors' dtype; fp32 factors take the epilogue's one fp32 product)
    for T, E, k, N, K, G, r, crowd, fdt in (
            (140, 2, 1, 128, 128, 3, 20, True, torch.bfloat16), (6, 4, 2, 128, 128, 1, 4, False, torch.bfloat16),
            (10, 4, 2, 128, 128, 2, 8, False, torch.float32), (11, 5, 2, 256, 256, 3, 6, False, torch.bfloat16),
            (9, 4, 3, 64, 96, 2, 8, False, torch.bfloat16)):
        x, rows, offsets = case(T, E, k, N, K, crowd)
        w = (torch.randn(E, N, K, generator=g) * K**-0.5).bfloat16()
        A = (torch.randn(E * G, r, K, generator=g) * K**-0.5).bfloat16().to(fdt)
        B = (torch.randn(E * G, N, r, generator=g) * 0.5).bfloat16().to(fdt)
        expert = torch.repeat_interleave(torch.arange(E), torch.diff(offsets, prepend=offsets.new_zeros(1)))
        grp = torch.randint(0, G, (rows.shape[0],), generator=g)
        order = torch.sort(expert * G + grp, stable=True).indices  # rows sorted by (expert, group)
        rows, grp = rows[order], grp[order]
        pair = expert * G + grp
        pair_ends = torch.cumsum(torch.bincount(pair, minlength=E * G), 0).to(torch.int32)
        scale = torch.rand(rows.shape[0], generator=g).bfloat16() + 0.5
        xb = x.bfloat16()
        xd = xb.double()[rows]
        h = torch.einsum("ik,irk->ir", xd, A.double()[pair])
        ref = torch.einsum("ik,ink->in", xd, w.double()[expert]) + scale.double()[:, None] * torch.einsum(
            "ir,inr->in", h, B.double()[pair])
        lo = ed.ExpertLora(A, B, scale, grp, G, pair_ends)
        y = ed.expert_linear(xb, rows, w, offsets, out_dtype=torch.float32, lora=lo)
        err = float((y.double() - ref).abs().max() / ref.abs().max())
        assert err < 1e-5, ("lora", T, E, G, r, err)
        if K % 128 == 0 and N % 128 == 0:
            q, s = quant.quantize_fp8_block(w.float(), 128)
            xq, xs = fq.quantize_act_fp8(xb)  # bf16 input (the interpreter truncates fp32 -> bf16)
            xq = (xq.double().reshape(T, K // 128, 128) * xs.double()[..., None]).reshape(T, K)[rows]
            ref8 = torch.einsum("ik,ink->in", xq, quant.dequant_fp8_block(q, s).double()[expert]) + \
                scale.double()[:, None] * torch.einsum("ir,inr->in", h, B.double()[pair])
            y8 = ed.expert_linear(xb, rows, q, offsets, s, out_dtype=torch.float32, lora=lo)
            err = float((y8.double() - ref8).abs().max() / ref8.abs().max())
            assert err < 1e-5, ("fp8 lora", T, E, G, r, err)
        n += 1

    # an MoE layer with an adapter: under no_grad the kernel (LoRA in its epilogue), with
    # gradients the grouped products of the training path
    class Route:  # the two groups a sampler's route gives: no adapter, and one adapter
        moe_adapters = [0, 1]

        def __init__(self, tokens):
            self.tokens = tokens

        def moe_token_group(self):
            return (torch.arange(self.tokens) % 2)

        def expert_factors(self, name, row_group, dtype):
            A, B = factors[name.rsplit(".", 1)[-1]]
            return A, B, torch.full((row_group.shape[0],), 2.0, dtype=dtype)

    factors = {}
    for name, (i, o) in experts.lora_shapes().items():
        A = (torch.randn(E, 2, 4, i, generator=g) * i**-0.5).bfloat16()
        B = (torch.randn(E, 2, o, 4, generator=g) * 0.5).bfloat16()
        A[:, 0], B[:, 0] = 0, 0  # group 0: rows without an adapter
        factors[name] = (A.reshape(E * 2, 4, i), B.reshape(E * 2, o, 4))
    with torch.no_grad():
        fast = experts(xin, routing, Route(T))
        plain = experts(xin, routing, None)
    ref = experts(xin.detach().requires_grad_(), routing, Route(T)).detach()
    assert float((fast.float() - ref.float()).abs().max() / ref.float().abs().max()) < 2e-2
    scale = ref.float().abs().max()
    assert float((fast.float() - plain.float())[1::2].abs().max() / scale) > 5e-2  # the adapter's term is there
    assert float((fast.float() - plain.float())[0::2].abs().max() / scale) < 1e-2  # rows without an adapter: none
    print("OK", n)
    """
)


def test_expert_decode_kernel_matches_references():
    assert "OK" in run_interpreted(SCRIPT, timeout=900)


def test_expert_linear_shape_errors():
    from ember.core.kernels import expert_decode

    if not expert_decode.fused.HAVE_TRITON:
        pytest.skip("no triton")
    w = torch.zeros(2, 128, 128, dtype=torch.float8_e4m3fn)
    x = torch.zeros(3, 128)
    with pytest.raises(ValueError, match="offsets"):
        expert_decode.expert_linear(x, None, w, torch.tensor([3], dtype=torch.int32), torch.ones(2, 1, 1))
    with pytest.raises(ValueError, match="scale_inv"):
        expert_decode.expert_linear(x, None, w, torch.tensor([1, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match="multiples"):
        expert_decode.expert_linear(torch.zeros(3, 96), None, w[..., :96], torch.tensor([1, 3], dtype=torch.int32),
                                    torch.ones(2, 1, 1))


def test_takes_only_decode_shapes_without_gradients():
    from ember.core.kernels import expert_decode

    w = torch.zeros(8, 16, 32, dtype=torch.bfloat16)
    x = torch.zeros(4, 32, dtype=torch.bfloat16)
    with torch.no_grad():
        assert expert_decode.takes(x, None, w) == expert_decode.available(x)
        assert not expert_decode.takes(torch.zeros(8 * 17, 32, dtype=torch.bfloat16), None, w)  # prefill-sized
        assert not expert_decode.takes(x.float(), None, w.float())  # fp32 weights: grouped products
    assert not expert_decode.takes(x, None, w)  # gradients on: training


def test_expert_product_falls_back_to_grouped_products():
    """Where the kernel cannot run (here: the CPU without the interpreter) or failed, the product is
    the grouped one of the gathered rows, on the dequantised weights for an fp8 copy."""
    from ember.core import quant
    from ember.core.kernels import expert_decode
    from ember.core.kernels.grouped import grouped_linear

    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 256, generator=g)
    rows = torch.tensor([0, 3, 1, 5, 2, 4, 0])
    offsets = torch.tensor([3, 3, 7], dtype=torch.int32)
    w = torch.randn(3, 128, 256, generator=g) * 0.05
    q, s = quant.quantize_fp8_block(w, 128)
    if expert_decode.available(x):
        pytest.skip("the kernel runs here (interpreter): covered above")
    y = expert_decode.expert_product(x, rows, q, offsets, s)
    torch.testing.assert_close(y, grouped_linear(x[rows], quant.dequant_fp8_block(q, s), offsets))
    torch.testing.assert_close(expert_decode.expert_product(x, rows, w, offsets), grouped_linear(x[rows], w, offsets))
