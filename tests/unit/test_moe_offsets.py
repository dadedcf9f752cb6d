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
        experts.down_proj[e] @ experts.activation(experts.gate_up_proj[e] @ x[t])
        for t, e in enumerate(routing.experts[:, j].tolist())]) for j in range(k))
    assert torch.allclose(got, want) and torch.allclose(got, ref)


def moe_layer_case(dtype: torch.dtype, seed: int = 0):
    """An MoE layer (8 experts, top-3, 13 tokens) with a LoRA adapter on both expert projections:
    its output and the gradients of its input and of the adapter's factors, in ``dtype`` (the
    same draws in every dtype)."""
    from types import SimpleNamespace

    from ember.core.layers.lora import LoraRoute, LoraWeights, TokenGroup

    g = torch.Generator().manual_seed(seed)
    T, H, I, E, k, r = 13, 24, 10, 8, 3, 4

    def draw(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)

    experts = Experts(H, I, E).to(dtype)
    experts.lora_name = "layers.0.mlp.experts"
    with torch.no_grad():
        experts.gate_up_proj.copy_(draw(E, 2 * I, H, scale=H**-0.5))
        experts.down_proj.copy_(draw(E, H, I, scale=I**-0.5))
    factors = {
        "gate_up_proj": LoraWeights(draw(E, r, H, scale=0.3).requires_grad_(), draw(E, 2 * I, r, scale=0.3).requires_grad_()),
        "down_proj": LoraWeights(draw(E, r, I, scale=0.3).requires_grad_(), draw(E, H, r, scale=0.3).requires_grad_()),
    }
    adapter = SimpleNamespace(weights={f"{experts.lora_name}.{n}": w for n, w in factors.items()}, scale=0.5)
    lora = LoraRoute([TokenGroup(adapter, 0, T)], torch.device("cpu"))
    x = draw(T, H).requires_grad_()
    choice = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    routing = Routing(choice, torch.rand(T, k, generator=g, dtype=torch.float64).to(dtype))
    out = experts(x, routing, lora)
    (out * draw(T, H)).sum().backward()
    return (out.detach(), x.grad, torch.cat([w.A.grad.flatten() for w in factors.values()]),
            torch.cat([w.B.grad.flatten() for w in factors.values()]))


def moe_layer_against_fp64(kernels_off, tol: float = 1e-5) -> None:
    """:func:`moe_layer_case` in fp32 as the code runs now (a kernel test's: under Triton's
    interpreter), then in fp64 after ``kernels_off()`` turns its kernels off: the output and every
    gradient within ``tol`` (relative norm)."""
    got = moe_layer_case(torch.float32)
    kernels_off()
    ref = moe_layer_case(torch.float64)
    for name, g, r in zip(("out", "dx", "dA", "dB"), got, ref):
        err = ((g.double() - r).norm() / r.norm()).item()
        assert err < tol, (name, err)
