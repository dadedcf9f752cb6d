"""Which implementation of the gated delta rule a GDN layer takes (fla's kernels only on CUDA)."""


import pytest
import torch

from ember.core.layers import gated_deltanet as gd


def test_the_cpu_takes_the_pytorch_rule_and_refuses_fla_clearly():
    x = torch.zeros(2, 4, dtype=torch.bfloat16)
    assert gd.gdn_backend(x) == "torch"
    assert gd.gdn_backend(x, "torch") == "torch"
    with pytest.raises(RuntimeError, match="needs a CUDA device and fla-core"):
        gd.gdn_backend(x, "fla")
    with pytest.raises(ValueError, match="GDN backend must be one of"):
        gd.gdn_backend(x, "triton")


def test_a_layer_with_the_torch_backend_requested_equals_the_default_on_the_cpu():
    torch.manual_seed(0)
    shape = gd.GDNShape(2, 4, 8, 8, 4, 1e-6, "silu")
    layer = gd.GatedDeltaNet(32, shape, 0, fused_projections=True).double()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    from ember.core.models.base import ForwardContext

    x = torch.randn(23, 32, dtype=torch.float64)
    ctx = dict(positions=torch.zeros(23, dtype=torch.long), attend=None, seq_lens=[10, 13])
    default = layer(x, ForwardContext(**ctx))
    layer.backend = "torch"
    assert torch.equal(layer(x, ForwardContext(**ctx)), default)
    layer.backend = "fla"
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        layer(x, ForwardContext(**ctx))


def _fla_naive(q, k, v, g=None, gk=None, gv=None, beta=None, scale=None, initial_state=None,
               output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs):
    """fla-core 0.4.2's ``(fused_recurrent|chunk)_gated_delta_rule`` contract, token by token in
    fp64: ``q, k`` ``[1|N, T, H, K]``, ``g, beta`` ``[.., T, H]``, states ``[N, H, K, V]``, the
    decays ``gk``/``gv`` between ``g`` and ``beta`` in the recurrent form's positional order."""
    assert gk is None and gv is None and g is not None and beta is not None
    if cu_seqlens is None:  # one row per sequence
        rows = [(i, 0, q.shape[1]) for i in range(q.shape[0])]
    else:
        assert q.shape[0] == 1 and "cu_seqlens_cpu" in kwargs
        cu = cu_seqlens.tolist()
        rows = [(0, cu[i], cu[i + 1]) for i in range(len(cu) - 1)]
    dtype = v.dtype
    q, k, v, g, beta = (t.double() for t in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = gd.l2norm(q), gd.l2norm(k)
    o = torch.zeros_like(v)
    finals = []
    for n, (b, lo, hi) in enumerate(rows):
        h = (initial_state[n].double() if initial_state is not None
             else q.new_zeros(q.shape[2], q.shape[3], v.shape[3]))
        for t in range(lo, hi):
            h = h * g[b, t].exp()[:, None, None]
            delta = beta[b, t][:, None] * (v[b, t] - torch.einsum("hkv,hk->hv", h, k[b, t]))
            h = h + torch.einsum("hk,hv->hkv", k[b, t], delta)
            o[b, t] = torch.einsum("hkv,hk->hv", h, q[b, t] * scale)
        finals.append(h)
    return o.to(dtype), (torch.stack(finals).float() if output_final_state else None)


@pytest.mark.parametrize("key_heads", [4, 2])
def test_the_fla_call_follows_fla_s_signatures_and_layouts(monkeypatch, key_heads):
    """Ember's call of fla (prefill of packed sequences with initial states, then one decode
    token each) against the torch rule, with fla's kernels replaced by its contract in fp64; q and
    k at the key heads (4 value heads: one each, or two value heads a key head)."""
    monkeypatch.setattr(gd, "_fla_ops", lambda: (_fla_naive, _fla_naive))
    torch.manual_seed(0)
    H, Hk, dk, dv, lens = 4, key_heads, 8, 6, [5, 9, 3]
    T, r = sum(lens), H // key_heads

    def inputs(t):
        return (torch.randn(t, Hk, dk), torch.randn(t, Hk, dk), torch.randn(t, H, dv),
                -torch.rand(t, H), torch.rand(t, H))

    def normed(q, k):
        return gd.l2norm(q.repeat_interleave(r, 1)) * dk**-0.5, gd.l2norm(k.repeat_interleave(r, 1))

    h0 = torch.randn(len(lens), H, dk, dv)
    q, k, v, g, beta = inputs(T)
    o, final = gd.fla_gated_delta_rule(q, k, v, g, beta, lens, h0, True)
    ref_o, ref_final = gd.chunk_gated_delta_rule(*normed(q, k), v, g, beta, lens, h0)
    assert torch.allclose(o, ref_o, atol=1e-5) and torch.allclose(final, ref_final, atol=1e-5)
    q, k, v, g, beta = inputs(len(lens))
    o, state = gd.fla_gated_delta_rule(q, k, v, g, beta, [1] * len(lens), final, True)
    ref_o, ref_state = gd.recurrent_gated_delta_rule(*normed(q, k), v, g, beta, ref_final)
    assert torch.allclose(o, ref_o, atol=1e-5) and torch.allclose(state, ref_state, atol=1e-5)
