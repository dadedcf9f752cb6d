"""The decode LoRA kernels (split-K shrink, fused expand-add) equal a float64 reference
(run on the CPU through Triton's interpreter)."""

import textwrap

import pytest

from tests.triton_interp import run_interpreted

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import types
    import torch
    from tests.triton_interp import LaunchGrids, patch_interpreter, rel_err as rel
    patch_interpreter()

    from ember.core.kernels import fused, lora_decode as ld
    from ember.core.sampling.static_route import StaticRoute
    assert fused.use_triton(torch.zeros(1)) and ld.triton_ok(torch.zeros(1))

    def stacks(G, R, rank, K, O, dtype, zero_first=True, seed=0):
        # as LoraStacks builds them: rank padded up to the stack's R with zeros, slot 0 zeros
        g = torch.Generator().manual_seed(seed)
        A = torch.randn(G, R, K, generator=g) / K ** 0.5
        B = torch.randn(G, O, R, generator=g) / rank ** 0.5
        A[:, rank:] = 0
        B[:, :, rank:] = 0
        if zero_first:
            A[0] = 0
            B[0] = 0
        return A.to(dtype), B.to(dtype)

    def reference(y, x, A, B, offs, n_rows=None, skip_first=False):
        ref = y.double().clone()
        start = 0
        for g, end in enumerate(offs.tolist()):
            end_ = min(end, n_rows) if n_rows is not None else end
            start_ = min(start, end_)
            if end_ > start_ and not (skip_first and g == 0):
                ref[start_:end_] += x[start_:end_].double() @ A[g].double().T @ B[g].double().T
            start = end
        return ref

    def check(name, got, ref, tol):
        err = rel(got, ref)
        assert err <= tol, (name, err)
        print(f"{name}: {err:.1e}")

    # (sizes of the groups, stack rank R, adapter rank, in, out)
    cases = [
        ([3, 0, 20, 0, 14], 32, 24, 200, 150),     # empty groups, rows not a multiple of the block
        ([0, 70, 0, 45, 5], 48, 40, 96, 520),    # stack rank 48 (padded to 64), 2 row blocks in a group
        ([9, 0, 0], 16, 16, 4096 + 24, 33),        # big in (128-wide K blocks), one real group
        ([0, 0, 0, 0], 32, 32, 64, 64),            # only one (padding) row, in the last group
        ([2, 0, 0, 5, 0, 0, 0, 3, 0, 1, 4], 16, 16, 64, 48),  # more groups than programs per split
    ]
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1.5e-2)):
        for i, (sizes, R, rank, K, O) in enumerate(cases):
            N = max(sum(sizes), 1)
            offs = torch.cumsum(torch.tensor(sizes), 0).to(torch.int32)
            offs[-1] = N
            for zero_first in (True, False):
                A, B = stacks(len(sizes), R, rank, K, O, dtype, zero_first, seed=i)
                x = torch.randn(N, K).to(dtype)
                y0 = torch.randn(N, O).to(dtype)
                skip = zero_first
                # shrink alone: fp32 h
                h = ld.lora_shrink(x, A, offs, skip_first=skip)
                assert h.dtype == torch.float32 and h.shape == (N, R)
                href = torch.zeros(N, R, dtype=torch.float64)
                s = 0
                for g, e in enumerate(offs.tolist()):
                    if e > s and not (skip and g == 0):
                        href[s:e] = x[s:e].double() @ A[g].double().T
                    s = e
                check(f"shrink {dtype} case {i} zero_first={zero_first}", h, href, 1e-5)
                # narrow K blocks, rank rows split over programs
                h2 = ld.lora_shrink(x, A, offs, skip_first=skip, config=(16, 16))
                check(f"shrink block_k=16 r_block=16 {dtype} case {i}", h2, href, 1e-5)
                # one program per group, or fewer groups than that (the benchmark's group_programs)
                for gp in (1, 8):
                    h3 = ld.lora_shrink(x, A, offs, skip_first=skip, group_programs=gp)
                    check(f"shrink group_programs={gp} {dtype} case {i}", h3, href, 1e-5)
                    y = ld.lora_expand_add(torch.zeros(N, O, dtype=dtype), h3, B, offs, skip_first=skip,
                                           group_programs=gp)
                    check(f"expand group_programs={gp} {dtype} case {i}", y,
                          reference(torch.zeros(N, O), x, A, B, offs, skip_first=skip), tol)
                # the whole delta, added in place
                y = y0.clone()
                out = ld.lora_delta_add(y, x, A, B, offs, skip_first=skip)
                assert out.data_ptr() == y.data_ptr() and out.dtype == dtype
                check(f"delta_add {dtype} case {i} zero_first={zero_first}", y, reference(y0, x, A, B, offs), tol)
                # padding rows (from n_rows on) are left untouched
                n_real = max(N - 4, 0)
                y = y0.clone()
                ld.lora_delta_add(y, x, A, B, offs, torch.tensor([n_real], dtype=torch.int32), skip_first=skip)
                assert torch.equal(y[n_real:], y0[n_real:])
                check(f"delta_add rows {dtype} case {i}", y, reference(y0, x, A, B, offs, n_real), tol)

    # a bank of 33 slots with rows in two of them: launches sized by a bound on the active groups
    # (the static decoder's, from the step's rows) give the same delta as launches over every slot;
    # with a bound of 2 every call launches 2 programs per split, not 8
    sizes = [0] * 33
    sizes[5], sizes[30] = 6, 9
    offs = torch.cumsum(torch.tensor(sizes), 0).to(torch.int32)
    A, B = stacks(33, 16, 16, 64, 48, torch.float32, seed=7)
    x, y0 = torch.randn(15, 64), torch.randn(15, 48)
    want = reference(y0, x, A, B, offs)
    launched = LaunchGrids(ld, "_lora_shrink_kernel")
    none = ld.active_groups(offs, skip_first=True, bound=0)
    y = ld.lora_expand_add(y0.clone(), torch.ones(15, 16), B, offs, skip_first=True, active=none)
    assert y.equal(y0)  # a bound of 0: no group has rows, nothing launched
    for bound in (None, 2, 3):
        active = ld.active_groups(offs, skip_first=True, bound=bound)
        assert active.bound == (32 if bound is None else bound)
        h = ld.lora_shrink(x, A, offs, skip_first=True, active=active)
        y = ld.lora_expand_add(y0.clone(), h, B, offs, skip_first=True, active=active)
        check(f"bank of 33, bound {bound}", y, want, 1e-5)
    launched.restore()
    assert [g[0] for g in launched.grids] == [8, 2, 3], launched.grids
    try:
        ld.active_groups(offs, skip_first=True, bound=-1)
        raise AssertionError("a negative bound was taken")
    except ValueError as e:
        assert "bound" in str(e)

    # a packed group's block-diagonal B (members of these output widths, R columns each): with
    # ``splits`` each block of outputs multiplies only its member's columns; widths whose common
    # power of two is below a tile (40, 24: 8) fall back to the whole of B
    for widths in ((64, 32, 32), (32, 96), (40, 24)):
        G, Rm, N = 4, 16, 37
        offs = torch.tensor([5, 17, 17, N], dtype=torch.int32)
        B = torch.zeros(G, sum(widths), len(widths) * Rm)
        o = 0
        for j, w in enumerate(widths):
            B[:, o : o + w, j * Rm : (j + 1) * Rm] = torch.randn(G, w, Rm) / Rm ** 0.5
            o += w
        B[0] = 0
        h = torch.randn(N, len(widths) * Rm)
        y0 = torch.randn(N, sum(widths))
        want = y0.double().clone()
        s = 0
        for g, e in enumerate(offs.tolist()):
            if e > s and g > 0:
                want[s:e] += h[s:e].double() @ B[g].double().T
            s = e
        for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
            y = ld.lora_expand_add(y0.clone().to(dtype), h, B.to(dtype), offs, skip_first=True, splits=widths)
            check(f"expand splits={widths} {dtype}", y, want, tol)
    try:
        ld.lora_expand_add(y0, h, B, offs, splits=(8, 8))
        raise AssertionError("splits that do not cover the outputs were taken")
    except ValueError as e:
        assert "splits" in str(e)

    # a windowed h [N, P, r] (the shrink carried out by the base product): the i-th active group's
    # rows read window i, whatever the other windows hold at their rows (the product fills every
    # window for every row); with and without a packed group's splits
    for widths in ((48,), (32, 64)):
        G, Rm, N, P = 6, 16, 23, 4
        offs = torch.tensor([0, 7, 7, 15, 15, N], dtype=torch.int32)  # groups 1, 3, 5 have rows
        active = ld.active_groups(offs, skip_first=True, bound=P)
        B = torch.zeros(G, sum(widths), len(widths) * Rm)
        o = 0
        for j, w in enumerate(widths):
            B[1:, o : o + w, j * Rm : (j + 1) * Rm] = torch.randn(G - 1, w, Rm) / Rm ** 0.5
            o += w
        h = torch.randn(N, len(widths) * Rm)
        win = torch.randn(N, P, len(widths) * Rm) * 100  # rows outside a window's group: never read
        for i, (s, e) in enumerate(((0, 7), (7, 15), (15, N))):
            win[s:e, i] = h[s:e]
        y0 = torch.randn(N, sum(widths))
        splits = widths if len(widths) > 1 else None
        y = ld.lora_expand_add(y0.clone(), win, B, offs, skip_first=True, active=active, splits=splits)
        want = ld.lora_expand_add(y0.clone(), h, B, offs, skip_first=True, active=active, splits=splits)
        check(f"expand windowed splits={splits}", y, want.double(), 1e-6)
    try:
        ld.lora_expand_add(y0.clone(), win[:, :2], B, offs, skip_first=True, active=active, splits=splits)
        raise AssertionError("fewer windows than active groups were taken")
    except ValueError as e:
        assert "windows" in str(e)

    # an fp32 output (the LM head's logits) with bf16 activations and stacks; 3-d activations
    A, B = stacks(3, 32, 32, 128, 300, torch.bfloat16)
    offs = torch.tensor([2, 9, 13], dtype=torch.int32)
    x = torch.randn(13, 128).bfloat16()
    y0 = torch.randn(13, 300)
    y = ld.lora_delta_add(y0.clone(), x, A, B, offs, skip_first=True)
    assert y.dtype == torch.float32
    check("delta_add fp32 logits", y, reference(y0, x, A, B, offs), 1e-2)
    x3 = torch.randn(1, 13, 128)
    A, B = A.float(), B.float()
    y3 = ld.lora_delta_add(torch.zeros(1, 13, 300), x3, A, B, offs)
    check("delta_add 3-d", y3[0], reference(torch.zeros(13, 300), x3[0], A, B, offs), 1e-5)

    # StaticRoute on the kernels equals the grouped-product formula; "q" and "k" share an input and
    # their stacks (A side by side, B block-diagonal: one shrink for both, into the step's
    # workspace), "o" is alone
    R = A.shape[1]
    A_qk = torch.cat([A, 0.5 * A], dim=1)
    B_k = B[:, :200].clone()
    B_qk = torch.zeros(B.shape[0], 500, 2 * R)
    B_qk[:, :300, :R] = B
    B_qk[:, 300:, R:] = B_k
    A_o, B_o = A.clone(), B.clone()
    st = types.SimpleNamespace(
        stacks={"q": (A_qk[:, :R], B_qk[:, :300, :R]), "k": (A_qk[:, R:], B_qk[:, 300:, R:]), "o": (A_o, B_o)},
        fused={"q": (A_qk, B_qk), "o": (A_o, B_o)},
        member={"q": ("q", 0), "k": ("q", 1), "o": ("o", 0)},
        splits={"q": (300, 200), "o": (300,)},
        rank=R,
    )
    W = torch.randn(300, 128)
    xf = torch.randn(13, 128)
    shrinks = []
    real_shrink = ld.lora_shrink
    ld.lora_shrink = lambda *a, **k: shrinks.append(a[1].shape) or real_shrink(*a, **k)
    route = StaticRoute(st, offs, torch.tensor([11], dtype=torch.int32))
    check("route.linear", route.linear("q", xf, W, None)[:11], (xf @ W.T + ld.lora_delta_torch(xf, A, B, offs))[:11], 1e-5)
    ref_k = xf @ W[:200].T + ld.lora_delta_torch(xf, 0.5 * A, B_k, offs)
    check("route.linear shared input", route.linear("k", xf, W[:200], None)[:11], ref_k[:11], 1e-5)
    assert shrinks == [A_qk.shape], shrinks  # k reused q's shrink
    x2 = torch.randn(13, 128)  # another input: computed again
    check("route.delta", route.delta("k", x2)[:11], ld.lora_delta_torch(x2, 0.5 * A, B_k, offs)[:11], 1e-5)
    check("route.delta alone", route.delta("o", xf)[:11], ld.lora_delta_torch(xf, A, B, offs)[:11], 1e-5)
    assert len(shrinks) == 3
    assert route.delta("other", xf) is None and route.linear("other", xf, W, None).equal(xf @ W.T)

    # packed base weights: one GEMM, one shrink and one expand for the group; members get their columns
    from torch import nn
    from ember.core.layers.lora import LoraLinear
    from ember.core.sampling.packed_linears import PackedLinears

    mlp = nn.Module()  # a gate/up pair (named "q" and "k" for the stacks above)
    mlp.gate_proj, mlp.up_proj = LoraLinear(128, 300, False, "mlp"), LoraLinear(128, 200, False, "mlp")
    mlp.gate_proj.lora_name, mlp.up_proj.lora_name = "q", "k"
    mlp.gate_proj.weight.data.copy_(W)
    mlp.up_proj.weight.data.copy_(W[:200])
    packed = PackedLinears(types.SimpleNamespace(modules=lambda: [mlp]))
    assert packed.weights["q"][0].shape == (500, 128) and mlp.up_proj.weight.equal(W[:200])
    again = PackedLinears(types.SimpleNamespace(modules=lambda: [mlp]))  # a second decoder: no copy
    assert again.weights["q"][0].data_ptr() == packed.weights["q"][0].data_ptr()
    shrinks.clear()
    route = StaticRoute(st, offs, torch.tensor([11], dtype=torch.int32), packed)
    q = route.linear("q", xf, mlp.gate_proj.weight, None)
    k = route.linear("k", xf, mlp.up_proj.weight, None)
    check("packed q", q[:11], (xf @ W.T + ld.lora_delta_torch(xf, A, B, offs))[:11], 1e-5)
    check("packed k", k[:11], ref_k[:11], 1e-5)
    assert shrinks == [A_qk.shape], shrinks
    # a weight that is no longer the packed view is used as it is
    mlp.up_proj.weight.data = W[:200].clone() * 2
    k2 = route.linear("k", xf, mlp.up_proj.weight, None)
    check("unpacked k", k2[:11], (xf @ (2 * W[:200]).T + ld.lora_delta_torch(xf, 0.5 * A, B_k, offs))[:11], 1e-5)
    # base only (no adapters in the batch)
    route = StaticRoute(st, offs, torch.tensor([11], dtype=torch.int32), packed, lora=False)
    check("packed q, base only", route.linear("q", xf, mlp.gate_proj.weight, None), xf @ W.T, 1e-6)
    print("OK")
    """
)


def test_lora_decode_kernels_match_reference():
    assert "OK" in run_interpreted(SCRIPT, timeout=600)
