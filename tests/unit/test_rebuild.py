"""Saved activations rebuilt in the backward (ember.core.rebuild): a training pass gives the same
logprobs and bitwise the same gradients with and without it while keeping less, and the recipes
are never read stale (an input changed in place, a storage address reused)."""

from __future__ import annotations

import gc

import pytest
import torch

from ember.core import rebuild
from ember.core.layers.activations import silu_mul
from ember.core.layers.norms import rms_norm
from ember.core.layers.rope import apply_rope
from tests.unit.test_activation_checkpointing import (  # noqa: F401
    FAMILIES,
    _requests,
    _step,
    _worker,
    assert_same_pass,
    model_dirs,
)


@pytest.fixture
def baseline():
    """Run a block with ``rebuild.enabled`` off, restoring it after."""
    class Off:
        def __enter__(self):
            rebuild.enabled = False

        def __exit__(self, *exc):
            rebuild.enabled = True

    return Off


@pytest.mark.parametrize("family", FAMILIES)
def test_a_pass_with_rebuilt_activations_equals_the_plain_one(family, model_dirs, baseline):  # noqa: F811
    worker = _worker(model_dirs[family])
    requests = _requests(worker.config.vocab_size)
    with baseline():
        plain, g_plain, _, kept_plain = _step(worker, "off", requests)
    rebuilt, g_rebuilt, _, kept_rebuilt = _step(worker, "off", requests)
    # every family's norm outputs feed LoRA products, so some are rebuilt (the totals include the
    # adapters' factors, which dominate at these sizes: bench/activation_split.py has the split)
    assert kept_rebuilt < kept_plain, (kept_rebuilt, kept_plain)
    assert_same_pass(plain, g_plain, rebuilt, g_rebuilt, tol=0)


def _lora_like(x: torch.Tensor, A: torch.Tensor) -> torch.Tensor:
    """A product that saves its input for A's gradient, as a LoRA product does."""
    return x @ A


def _grads(build, *leaves):
    out = build()
    out.square().sum().backward()
    grads = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    return grads


def test_norm_rope_and_activation_rebuilt_bitwise_and_kept_as_recipes():
    torch.manual_seed(0)
    x = torch.randn(6, 2, 8, requires_grad=True)
    w = torch.randn(8)
    A = torch.randn(8, 3, requires_grad=True)
    gu = torch.randn(6, 10, requires_grad=True)
    cos, sin = torch.randn(6, 8), torch.randn(6, 8)
    calls = {"norm": 0}

    def norm(*a):
        calls["norm"] += 1
        return rms_norm(*a)

    made = {}

    def build():
        y = rms_norm(x, w, 1e-6)
        rebuild.rebuildable(y, norm, x, w, 1e-6)  # counted re-declaration of the same storage
        q = apply_rope(y, cos, sin)  # chained: its input is a declared norm output
        gate, up = gu.chunk(2, dim=-1)
        act = silu_mul(gate, up)
        made.update(y=y.data_ptr(), q=q.data_ptr(), act=act.data_ptr())
        # y is saved twice (two products) and rebuilt once; q and act once each
        return (_lora_like(y, A).sum() + _lora_like(y[:, 1], A).sum() + (q * q).sum()
                + (act @ torch.ones(5, 2)).sum())

    plain = _grads(build, x, A, gu)
    kept = []
    with rebuild.rebuilding(), rebuild.observing(lambda t: kept.append(t.untyped_storage().data_ptr())):
        out = build()
    assert kept and not set(made.values()) & set(kept)  # y, q and act were saved as recipes
    out.square().sum().backward()
    assert calls["norm"] == 1
    for g, ref in zip([x.grad, A.grad, gu.grad], plain):
        torch.testing.assert_close(g, ref, atol=0, rtol=0)


def test_an_input_changed_in_place_is_refused_not_read_stale():
    x = torch.randn(4, 8, requires_grad=True)
    A = torch.randn(8, 2, requires_grad=True)
    with rebuild.rebuilding():
        h = x * 1.0  # a residual stream that the norm keeps
        out = _lora_like(rms_norm(h, torch.ones(8), 1e-6), A).sum()
    with torch.no_grad():
        h.add_(1.0)
    with pytest.raises(RuntimeError, match="modified in place|modified by an inplace"):
        out.backward()


def test_declarations_end_with_their_tensors_and_outside_the_context():
    x = torch.randn(4, 8, requires_grad=True)
    with rebuild.rebuilding():
        y = rms_norm(x, torch.ones(8), 1e-6)
        assert len(rebuild._entries) == 1
        del y
        gc.collect()
        assert rebuild._entries == {}  # its address can be reused by another tensor: forgotten
        with torch.no_grad():
            rms_norm(x, torch.ones(8), 1e-6)
        assert rebuild._entries == {}  # nothing to save without grad mode
        rms_norm(x.detach(), torch.ones(8), 1e-6)
        assert rebuild._entries == {}  # no input needs a gradient: the norm keeps nothing to rebuild from
        apply_rope(x.view(4, 1, 8), torch.ones(4, 8), torch.zeros(4, 8))
        assert rebuild._entries == {}  # chained, and its input is not declared
    assert rebuild._entries is None
    rms_norm(x, torch.ones(8), 1e-6)  # outside: nothing registered anywhere
    assert rebuild._entries is None


def test_a_rebuild_of_another_layout_is_refused():
    x = torch.randn(4, 8, requires_grad=True)
    A = torch.randn(8, 2, requires_grad=True)
    with rebuild.rebuilding():
        y = x * 2.0
        rebuild.rebuildable(y, lambda t: (t * 2.0).t().contiguous().t(), x)
        out = _lora_like(y, A).sum()
    with pytest.raises(RuntimeError, match="differs in layout"):
        out.backward()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("wide", [False, True])
def test_the_lean_sigmoid_gate_is_autograds_formula_bit_for_bit(dtype, wide):
    """sigmoid_gate keeps o and gate only, yet gives exactly what autograd of the formula gives."""
    from ember.core.layers.activations import _gate_formula, sigmoid_gate

    g = torch.Generator().manual_seed(0)
    o0, gate0, dy = (torch.randn(9, 40, generator=g).to(dtype) for _ in range(3))
    outs = []
    for fn in (lambda o, z: _gate_formula(o, z, wide), lambda o, z: sigmoid_gate(o, z, wide)):
        o, gate = o0.clone().requires_grad_(), gate0.clone().requires_grad_()
        y = fn(o, gate)
        y.backward(dy)
        outs.append((y, o.grad, gate.grad))
    for a, b in zip(*outs):
        assert a.dtype == b.dtype and torch.equal(a, b)
