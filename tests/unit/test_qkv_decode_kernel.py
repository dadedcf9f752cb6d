"""The static decoder's one-launch q/k/v kernel (``ember.core.kernels.qkv_decode``) equals the three
kernels it replaces (the q/k/v LoRA expand, the q/k norms and rotations, the KV write), run on the
CPU through Triton's interpreter."""

import textwrap

import pytest

from tests.triton_interp import run_interpreted

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import torch
    from tests.triton_interp import assert_refused, patch_interpreter, rel_err as rel, seeded_randn
    patch_interpreter()

    from ember.core.kernels import fused, lora_decode as ld
    from ember.core.kernels.kv_write import kv_write
    from ember.core.kernels.qkv_decode import QkvLora, qkv_rope_write

    randn = seeded_randn(0)
    g = randn.generator

    def stack(G, widths, R, dtype):
        # as LoraStacks builds a packed group's B: block-diagonal over q, k, v; slot 0 zeros
        B = torch.zeros(G, sum(widths), 3 * R)
        start = 0
        for m, w in enumerate(widths):
            B[:, start:start + w, m * R:(m + 1) * R] = randn(G, w, R, scale=R ** -0.5)
            start += w
        B[0] = 0
        return B.to(dtype)

    def unfused(y, heads, D, cos, sin, kc, vc, slots, norms, lora):
        Hq, Hk = heads
        y = y.clone()
        if lora is not None:
            ld.lora_expand_add(y, lora.h, lora.B, lora.offsets, lora.n_rows, True, active=lora.active,
                               splits=(Hq * D, Hk * D, Hk * D))
        N = y.shape[0]
        q = y[:, : Hq * D].view(N, Hq, D)
        k = y[:, Hq * D : (Hq + Hk) * D].view(N, Hk, D)
        v = y[:, (Hq + Hk) * D :].view(N, Hk, D)
        qw, kw, eq, ek, zc = norms if norms is not None else (None, None, 0.0, 0.0, False)
        q, k = fused.qk_norm_rope(q, k, qw, kw, eq, ek, zc, cos, sin)
        kv_write(kc, vc, k, v, slots)
        return q

    # (rows per group, padded row count, Hq, Hk, head dim, rotary dims, rank): empty groups, padding
    # rows after n_rows, rows not a multiple of the 16-row block, several groups in one block, a
    # partial rotation (channels past it), a head width that is no power of two
    cases = [([3, 20, 0, 14], None, 4, 2, 32, 32, 16), ([0, 7, 5], 10, 2, 1, 32, 16, 8),
             ([1, 5, 3, 0, 7, 4, 2, 6], 25, 4, 2, 24, 24, 16), ([9], None, 2, 2, 64, 32, 32)]
    pages, page = 16, 4
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        for sizes, n_real, Hq, Hk, D, rot, R in cases:
            N = sum(sizes)
            offs = torch.cumsum(torch.tensor(sizes), 0).to(torch.int32)
            n_rows = torch.tensor([n_real], dtype=torch.int32) if n_real is not None else None
            active = ld.active_groups(offs, n_rows, skip_first=True)
            widths = (Hq * D, Hk * D, Hk * D)
            B = stack(len(sizes), widths, R, dtype)
            y = randn(N, sum(widths)).to(dtype)
            h = randn(N, 3 * R)
            pos = torch.randint(0, 50, (N,), generator=g)
            inv = 1.0 / (10000 ** (torch.arange(0, rot, 2).float() / rot))
            emb = torch.cat([pos[:, None] * inv, pos[:, None] * inv], dim=-1)
            cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
            slots = torch.randperm(pages * page, generator=g)[:N]
            qw, kw = (1.0 + 0.1 * randn(D)).to(dtype), (1.0 + 0.1 * randn(D)).to(dtype)
            for norms in ((qw, kw, 1e-6, 1e-5, False), (qw - 1, kw - 1, 1e-6, 1e-6, True), None):
                for lora in (QkvLora(h, B, offs, n_rows, active), None):
                    want_kc = randn(pages, page, Hk, D).to(dtype)
                    want_vc = randn(pages, page, Hk, D).to(dtype)
                    kc, vc = want_kc.clone(), want_vc.clone()
                    want_q = unfused(y, (Hq, Hk), D, cos, sin, want_kc, want_vc, slots, norms, lora)
                    q = qkv_rope_write(y, (Hq, Hk), cos, sin, kc, vc, slots, norms, lora)
                    what = (dtype, sizes, D, rot, norms is not None and norms[-1], lora is not None)
                    assert q.shape == (N, Hq, D) and q.dtype == dtype, what
                    for name, got, want in (("q", q, want_q), ("k", kc, want_kc), ("v", vc, want_vc)):
                        err = rel(got, want)
                        assert err <= tol, (what, name, err)
                    # the cache's other slots are untouched
                    other = torch.ones(pages * page, dtype=torch.bool)
                    other[slots] = False
                    assert torch.equal(kc.view(-1, Hk, D)[other], want_kc.view(-1, Hk, D)[other]), what
            # h windowed (the shrink carried out by the q/k/v product): the i-th active group's rows
            # read window i; the other windows hold garbage at their rows
            win = randn(N, active.bound, 3 * R, scale=100.0)
            ids, count = active.ids.tolist(), int(active.count)
            for i, grp in enumerate(ids[:count]):
                s, e = (int(offs[grp - 1]) if grp else 0), int(offs[grp])
                win[s:e, i] = h[s:e]
            want_kc, want_vc = torch.zeros(pages, page, Hk, D, dtype=dtype), torch.zeros(pages, page, Hk, D, dtype=dtype)
            kc, vc = want_kc.clone(), want_vc.clone()
            norms = (qw, kw, 1e-6, 1e-6, False)
            want_q = unfused(y, (Hq, Hk), D, cos, sin, want_kc, want_vc, slots, norms, QkvLora(h, B, offs, n_rows, active))
            q = qkv_rope_write(y, (Hq, Hk), cos, sin, kc, vc, slots, norms, QkvLora(win, B, offs, n_rows, active))
            for name, got, want in (("q", q, want_q), ("k", kc, want_kc), ("v", vc, want_vc)):
                err = rel(got, want)
                assert err <= tol, (dtype, sizes, "windowed", name, err)
            print(dtype, sizes, "ok")

    # a bf16 product into an fp32 cache: keys rounded to bf16 first, as the rotated keys were
    y = randn(4, 4 * 16).to(torch.bfloat16)
    cos, sin = torch.ones(4, 16, dtype=torch.bfloat16), torch.zeros(4, 16, dtype=torch.bfloat16)
    kc, vc = torch.zeros(2, 4, 1, 16), torch.zeros(2, 4, 1, 16)
    slots = torch.tensor([5, 0, 7, 2])
    q = qkv_rope_write(y, (2, 1), cos, sin, kc, vc, slots)
    assert torch.equal(q.float(), y[:, :32].float().view(4, 2, 16))
    assert torch.equal(kc.view(-1, 16)[slots], y[:, 32:48].float())
    assert torch.equal(vc.view(-1, 16)[slots], y[:, 48:].float())
    # shapes that do not fit are refused
    assert_refused(lambda: qkv_rope_write(y[:, :60], (2, 1), cos, sin, kc, vc, slots),
                   lambda: qkv_rope_write(y, (2, 1), cos, sin, kc[:, :, :, :8], vc, slots),
                   lambda: qkv_rope_write(y, (2, 1), cos[:3], sin[:3], kc, vc, slots))
    print("OK")
    """
)


def test_qkv_kernel_matches_the_three_kernels():
    assert "OK" in run_interpreted(SCRIPT, timeout=900)
