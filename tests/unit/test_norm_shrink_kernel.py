"""The static decoder's norm-and-shrink kernel (``ember.core.kernels.norm_shrink``) equals the two
kernels it replaces (the RMSNorm, with or without the residual add, and the LoRA shrink of its
output), and a Llama layer decoded through ``StaticRoute.norm`` runs it for both of its norms (on
the CPU through Triton's interpreter; the engine's tokens against the eager decoder are checked by
``test_swiglu_decode_kernel.test_static_decode_through_the_kernels_equals_eager``)."""

import textwrap

import pytest

from tests.triton_interp import run_interpreted

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import torch
    from tests.triton_interp import patch_interpreter
    patch_interpreter()

    from ember.core.kernels import fused
    from ember.core.kernels import lora_decode as ld
    from ember.core.kernels.norm_shrink import norm_shrink

    g = torch.Generator().manual_seed(0)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()

    # (rows per group, width, rank, real rows): empty groups, a width that is no multiple of the
    # column block (nor of the sum's step), padding rows after n_rows, several groups in a row block
    cases = [([3, 20, 0, 14], 200, 16, None), ([0, 70, 5], 136, 48, 60), ([9], 512, 32, None),
             ([1, 5, 3, 0, 7, 4, 2, 6], 64, 16, 25)]
    for dtype in (torch.float32, torch.bfloat16):
        for sizes, K, R, n_real in cases:
            N = sum(sizes)
            offs = torch.cumsum(torch.tensor(sizes), 0).to(torch.int32)
            n_rows = torch.tensor([n_real], dtype=torch.int32) if n_real is not None else None
            active = ld.active_groups(offs, n_rows, skip_first=True)
            A = randn(len(sizes), R, K, scale=K ** -0.5)
            A[0] = 0
            A = A.to(dtype)
            x = randn(N, K).to(dtype)
            res = randn(N, K).to(dtype)
            for has_res in (False, True):
                for zero_centred in (False, True):
                    w = (randn(K, scale=0.1) + (0.0 if zero_centred else 1.0)).to(dtype)
                    # the two kernels it replaces
                    if has_res:
                        want_s, want_y = fused.add_rms_norm(x, res, w, 1e-6, zero_centred)
                    else:
                        want_s, want_y = None, fused.RMSNormFn.apply(x, w, 1e-6, zero_centred)
                    want_h = ld.lora_shrink(want_y, A, offs, n_rows, True, active=active)
                    for config in (None, (16, 64, 32, 4)):  # the default launch; 64-column programs in two steps
                        h = torch.zeros(N, R)
                        s, y = norm_shrink(x, res if has_res else None, w, 1e-6, zero_centred, A, h, offs, active,
                                           n_rows, config=config)
                        assert y.dtype == want_y.dtype and y.shape == want_y.shape
                        # rstd is summed in another order: a value may differ in its last bit
                        ulp = 1e-6 if dtype == torch.float32 else 8e-3
                        err = (y.double() - want_y.double()).abs().max().item()
                        assert err <= ulp * want_y.double().abs().max().item(), (dtype, sizes, has_res, "y", err)
                        if has_res:
                            assert torch.equal(s, want_s), (dtype, sizes, "s")
                        else:
                            assert s is None
                        err = rel(h, want_h)
                        assert err <= (1e-5 if dtype == torch.float32 else 1e-2), (dtype, sizes, has_res, "h", err)
                        # rows of slot 0 and padding rows get no shrink
                        skip = torch.ones(N, dtype=torch.bool)
                        skip[: min(offs[0].item(), N)] = False
                        live = torch.arange(N) < (n_real if n_real is not None else N)
                        assert (h[~(skip & live)] == 0).all(), (dtype, sizes, "rows without an adapter")
                        print(dtype, sizes, has_res, zero_centred, config, "ok")
    print("OK")
    """
)


def test_norm_shrink_kernel_matches_the_two_kernels():
    assert "OK" in run_interpreted(SCRIPT, timeout=900)


ROUTE_SCRIPT = textwrap.dedent(
    """
    import types
    import torch
    from torch import nn
    from tests.triton_interp import patch_interpreter
    patch_interpreter()

    from ember.core.kernels import lora_decode as ld
    from ember.core.layers.lora import LoraLinear
    from ember.core.layers.norms import RMSNorm
    from ember.core.sampling.static_route import PackedLinears, StaticRoute

    g = torch.Generator().manual_seed(0)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    def rel(a, b):
        return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()

    # a norm feeding a packed q/k/v group with LoRA on three slots (slot 0: the base model)
    H, R, N = 64, 16, 13
    outs = (32, 16, 16)
    attn = nn.Module()
    for name, o in zip(("q_proj", "k_proj", "v_proj"), outs):
        m = LoraLinear(H, o, False, "attn")
        with torch.no_grad():
            m.weight.copy_(randn(o, H, scale=H ** -0.5))
        m.lora_name = name
        setattr(attn, name, m)
    packed = PackedLinears(types.SimpleNamespace(modules=lambda: [attn]))
    A = randn(3, 3 * R, H, scale=H ** -0.5)
    B = torch.zeros(3, sum(outs), 3 * R)
    o = 0
    for j, n in enumerate(outs):
        B[:, o:o + n, j * R:(j + 1) * R] = randn(3, n, R, scale=R ** -0.5)
        o += n
    A[0], B[0] = 0, 0
    st = types.SimpleNamespace(
        stacks={n: (A[:, j * R:(j + 1) * R], B[:, sum(outs[:j]):sum(outs[:j + 1]), j * R:(j + 1) * R])
                for j, n in enumerate(("q_proj", "k_proj", "v_proj"))},
        fused={"q_proj": (A, B)}, member={n: ("q_proj", j) for j, n in enumerate(("q_proj", "k_proj", "v_proj"))},
        splits={"q_proj": outs}, rank=R,
    )
    norm = RMSNorm(H)
    with torch.no_grad():
        norm.weight.copy_(1 + randn(H, scale=0.1))
    offs = torch.tensor([2, 9, N], dtype=torch.int32)
    x, res = randn(N, H), randn(N, H)

    def layer(route, fused_norm, with_res):
        calls = []
        real = ld.lora_shrink
        ld.lora_shrink = lambda *a, **k: calls.append(a[1].shape) or real(*a, **k)
        try:
            consumer = attn.q_proj if fused_norm else None
            if with_res:
                s, y = norm.add(x, res, route, consumer)
            else:
                s, y = None, norm(x, route, consumer)
            out = [m(y, route) for m in (attn.q_proj, attn.k_proj, attn.v_proj)]
        finally:
            ld.lora_shrink = real
        return s, torch.cat(out, 1), calls

    with torch.no_grad():
        for with_res in (False, True):
            s0, want, calls = layer(StaticRoute(st, offs, torch.tensor([11], dtype=torch.int32), packed), False,
                                    with_res)
            assert calls == [A.shape], calls  # the group's one shrink, on its own
            s1, got, calls = layer(StaticRoute(st, offs, torch.tensor([11], dtype=torch.int32), packed), True,
                                   with_res)
            assert calls == [], calls  # the norm's kernel did it
            assert (s0 is None) == (s1 is None) and (s0 is None or torch.equal(s0, s1))
            err = rel(got[:11], want[:11])
            assert err <= 1e-5, (with_res, err)
            # against the formula in fp64 (rows 0-1 the base model's, 2-8 slot 1's, 9-10 slot 2's)
            xd = (x + res if with_res else x).double()
            yd = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight.double()
            ref = yd @ packed.weights["q_proj"][0].double().T
            for slot, rows in ((1, slice(2, 9)), (2, slice(9, 11))):
                ref[rows] += yd[rows] @ A[slot].double().T @ B[slot].double().T
            err = rel(got[:11], ref[:11])
            assert err <= 1e-5, (with_res, "fp64", err)
        # no adapter in the batch, or a consumer outside any packed group: the norm runs on its own
        assert StaticRoute(st, offs, None, packed, lora=False).norm(norm, x, None, attn.q_proj) is None
        lone = LoraLinear(H, 8, False, "attn")
        lone.lora_name = "lone"
        assert StaticRoute(st, offs, None, packed).norm(norm, x, None, lone) is None
    print("OK")
    """
)


def test_norm_feeding_a_packed_group_runs_its_shrink():
    assert "OK" in run_interpreted(ROUTE_SCRIPT, timeout=900)
