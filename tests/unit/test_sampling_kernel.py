"""The Triton sampling kernel (plain rows: greedy or temperature) picks the tokens of the fp64
PyTorch inverse-CDF draw and returns the temperature-1 logprob (run on the CPU through Triton's
interpreter)."""

import textwrap

import pytest

from tests.triton_interp import run_interpreted

pytest.importorskip("triton")

SCRIPT = textwrap.dedent(
    """
    import torch
    from tests.triton_interp import patch_interpreter
    patch_interpreter()

    from ember.core.kernels import sampling as ks
    from ember.core.sampling import logits as L
    assert ks.available(torch.zeros(1))

    def reference(z, inv_t, u):
        # the fp64 PyTorch draw (what CPU engines run), forced off the kernel
        ks_available, ks.available = ks.available, lambda z: False
        try:
            return L.sample_rows(z, inv_t, u)
        finally:
            ks.available = ks_available

    g = torch.Generator().manual_seed(0)
    V = 5000  # three blocks of 2048, the last one partial
    rows = []
    # (logits, inverse temperature, u)
    for inv_t in (0.0, 1.0, 0.5, 2.0):
        for u in (1e-9, 0.3, 0.77, 0.999):  # (u within rounding of a CDF boundary may differ)
            rows.append((torch.randn(V, generator=g) * 3, inv_t, u))
    peaked = torch.full((V,), -20.0)
    peaked[4321] = 5.0  # all the mass in the last block
    rows.append((peaked, 1.0, 0.5))
    masked = torch.randn(V, generator=g)
    masked[100:] = float("-inf")  # a row with impossible tokens (e.g. a padded vocabulary)
    rows += [(masked, 1.0, 1 - 1e-12), (masked, 0.0, 0.5)]
    ties = torch.zeros(V)
    ties[[7, 2100, 4999]] = 3.0  # greedy picks the first of equal maxima
    rows.append((ties, 0.0, 0.5))
    z = torch.stack([r[0] for r in rows]).float()
    inv_t = torch.tensor([r[1] for r in rows], dtype=torch.float64)
    u = torch.tensor([r[2] for r in rows], dtype=torch.float64)

    tok, lp = ks.sample_rows(z, inv_t, u)
    ref_tok, ref_lp = reference(z, inv_t, u)
    assert tok.dtype == torch.long and lp.dtype == torch.float32
    assert tok.tolist() == ref_tok.tolist(), (tok.tolist(), ref_tok.tolist())
    lp_ref = torch.log_softmax(z.double(), -1).gather(1, tok[:, None])[:, 0]
    assert (lp.double() - lp_ref).abs().max() < 1e-5, (lp, lp_ref)
    assert tok[-1] == 7 and tok[-4] == 4321 and int(tok[-3]) < 100 and int(tok[-2]) < 100
    assert int(tok[4]) == 0  # inv_t 1, u -> 0: the first token (every token has mass)

    # a wider vocabulary: chunks of several blocks (the scan walks blocks inside the chosen chunk)
    z2 = torch.randn(8, 40000, generator=g) * 2
    inv2 = torch.tensor([0.0, 1.0, 0.8, 1.3] * 2, dtype=torch.float64)
    u2 = torch.tensor([0.1, 0.35, 0.5, 0.65, 0.9, 0.05, 0.99, 0.42], dtype=torch.float64)
    assert ks.sample_rows(z2, inv2, u2)[0].tolist() == reference(z2, inv2, u2)[0].tolist()

    # a row's draw does not depend on the other rows of the batch
    alone = [ks.sample_rows(z[i : i + 1], inv_t[i : i + 1], u[i : i + 1])[0].item() for i in range(len(rows))]
    assert alone == tok.tolist()

    # the engine's entry point routes plain rows through the kernel and filtered ones through the sort
    temps = [0.0, 1.0, 0.7, 1.0]
    top_k = [-1, -1, 5, -1]
    top_p = [1.0, 1.0, 1.0, 0.5]
    us = [0.5, 0.3, 0.9, 0.6]
    got = L.sample_tokens(z[:4], temps, top_k, top_p, us)
    ks.available = lambda z: False
    want = L.sample_tokens(z[:4], temps, top_k, top_p, us)
    assert got.tolist() == want.tolist(), (got, want)
    print("OK")
    """
)


def test_sampling_kernel_matches_fp64_reference():
    assert "OK" in run_interpreted(SCRIPT, timeout=600)
