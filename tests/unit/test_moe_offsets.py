"""The grouped products' offsets of an MoE layer, found on the device without a host sync."""

import torch

from ember.core.layers.moe import Experts, Routing, pair_ends


def test_pair_ends_are_the_cumulative_counts_of_sorted_keys():
    torch.manual_seed(0)
    for rows, pairs in ((0, 6), (1, 1), (37, 12), (500, 64)):
        key = torch.randint(0, pairs, (rows,)).sort().values
        if rows > 20:
            key = key[(key != 3) & (key != pairs - 1)]  # empty pairs, the last one too
        want = torch.cumsum(torch.bincount(key, minlength=pairs), 0).to(torch.int32)
        got = pair_ends(key, pairs)
        assert got.dtype == torch.int32 and torch.equal(got, want), (rows, pairs)


def test_an_moe_layer_never_calls_bincount(monkeypatch):
    """bincount reads its input's maximum on the host (a device sync per MoE layer on CUDA)."""
    torch.manual_seed(0)
    T, H, I, E, k = 11, 8, 6, 5, 2
    experts = Experts(H, I, E).double()
    with torch.no_grad():
        experts.gate_up_proj.normal_()
        experts.down_proj.normal_()
    x = torch.randn(T, H, dtype=torch.float64)
    routing = Routing(torch.stack([torch.randperm(E)[:k] for _ in range(T)]), torch.rand(T, k, dtype=torch.float64))
    want = experts(x, routing, None)

    def refuse(*args, **kwargs):
        raise AssertionError("bincount called")

    monkeypatch.setattr(torch, "bincount", refuse)
    got = experts(x, routing, None)
    ref = sum(routing.weights[:, j, None] * torch.stack([
        experts.down_proj[e] @ experts.activation(*(experts.gate_up_proj[e] @ x[t]).chunk(2))
        for t, e in enumerate(routing.experts[:, j].tolist())]) for j in range(k))
    assert torch.allclose(got, want) and torch.allclose(got, ref)
