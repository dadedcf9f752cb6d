"""Bodies of the activation-checkpointing tests of a sharded worker, run on every rank
(:mod:`tests.parallel.launch`): with layers checkpointed, the recompute in backward runs each
layer's collectives again on every rank, and the pass's logprobs, gradients and route flips are
those of the same worker without checkpointing (fp32)."""

from __future__ import annotations

import numpy as np
import torch

from ember.dist.expert_parallel import set_mode
from ember.dist.mesh import Parallel
from ember.engine.sharded import ShardedWorker
from tests.lora_helpers import randomise
from tests.tiny_models import random_sequences
from tests.unit.test_activation_checkpointing import _requests
from tests.unit.test_mixed_batch import CONFIGS


def _grads(worker: ShardedWorker) -> dict[int, dict[str, torch.Tensor]]:
    out = {}
    for s in range(1, len(CONFIGS) + 1):
        a = worker.adapter(s)
        out[s] = {k: g.clone() for k, g in (a.grads() or {}).items()}
        a.optimizer.zero_grad()
    return out


def _same_grads(got, want) -> None:
    for s in want:
        assert got[s].keys() == want[s].keys()
        for k, g in want[s].items():
            torch.testing.assert_close(got[s][k], g, atol=1e-6, rtol=1e-6, msg=f"slot {s} {k}")


def checkpointed_step_matches(rank: int, world: int, model_dir: str, ep: int, tp: int = 1):
    worker = ShardedWorker.from_pretrained(model_dir, Parallel(ep, tp), "cpu", torch.float32, logprob_chunk=16,
                                           activation_checkpointing="on")
    for i, c in enumerate(CONFIGS):
        randomise(worker.adapter(worker.create_adapter(c)), seed=100 + i, scale=0.05)
    model, ckpt = worker.model, worker.checkpointing
    layers = model.config.num_layers

    # the engine's path: a mixed-adapter forward_backward (gradients summed over the ranks)
    requests = _requests(model.config.vocab_size)
    results = {}
    for mode in ("off", "on"):
        worker.activation_checkpointing = mode
        before = ckpt.recomputes
        outs = worker.forward_backward(requests)
        results[mode] = outs, _grads(worker), ckpt.recomputes - before
    (plain, g_plain, n_plain), (ckpt_outs, g_ckpt, n_ckpt) = results["off"], results["on"]
    assert n_plain == 0 and n_ckpt == layers
    for a, b in zip(plain, ckpt_outs):
        for x, y in zip(a.logprobs, b.logprobs):
            np.testing.assert_array_equal(y, x)
        assert b.metrics == a.metrics
    _same_grads(g_ckpt, g_plain)

    # R3 (a partial replay, flips against a reference) through the worker's pass, with the pass
    # state disturbed between forward and backward as a sampling run or another pass would leave
    # it: the recompute still sees this pass's dispatch mode and token split
    routers = model.moe_routers()
    L, k = len(routers), next(iter(routers.values())).top_k
    E = next(iter(routers.values())).weight.shape[0]
    seqs = random_sequences(model.config.vocab_size, [12, 20, 9, 7], seed=3)
    keys = [(1, True), (2, True), (3, True), (1, True)]
    targets = [torch.roll(torch.tensor(s), -1)[:, None] for s in seqs]
    g = torch.Generator().manual_seed(7)
    reference = [(torch.randint(0, E, (len(s), L, 1), generator=g) + torch.arange(k)) % E for s in seqs]
    replay = [r if i == 0 else torch.full_like(r, -1) for i, r in enumerate(reference)]
    out = {}
    for mode in ("off", "on"):
        worker.activation_checkpointing = mode
        with torch.enable_grad():
            per_seq, flips = worker._pass(seqs, keys, targets, None, (reference, replay))
            loss = sum((lp[:, 0] * (1 + i)).sum() for i, lp in enumerate(per_seq))
            set_mode(model, "replicated")  # sequence parallelism off too
            sp = getattr(model, "sequence_parallel", None)
            if sp is not None:
                sp.split(5)
            loss.backward()
            set_mode(model, "all_to_all")
        out[mode] = [lp.detach() for lp in per_seq], flips, _grads(worker)
    (lp_plain, f_plain, g_plain), (lp_ckpt, f_ckpt, g_ckpt) = out["off"], out["on"]
    for a, b in zip(lp_plain, lp_ckpt):
        torch.testing.assert_close(b, a, atol=0, rtol=0)
    for (fa, ca), (fb, cb) in zip(f_plain, f_ckpt):
        assert torch.equal(fa, fb) and torch.equal(ca, cb)
    assert sum(int(f.sum()) for f, _ in f_plain) > 0  # the replayed sequence's reference differs from live
    _same_grads(g_ckpt, g_plain)


def ranks_agree_on_the_layers(rank: int, world: int, model_dir: str):
    """``auto`` with different free memory on each rank: every rank checkpoints the layers of the
    rank that needs the most, in the same order; none when no rank needs any."""
    from ember.core.checkpointing import checkpoint_order
    from ember.engine.worker import agreed_layers

    worker = ShardedWorker.from_pretrained(model_dir, Parallel(world), "cpu", torch.float32)
    order = checkpoint_order(worker.model)
    layers = len(order)
    assert layers >= 2
    cases = [([], []), (sorted(order[:1]), []), ([], sorted(order[:2])), (sorted(order[:1]), list(range(layers)))]
    for mine, theirs in cases:
        want = max((mine, theirs), key=len)
        got = agreed_layers(worker.model, mine if rank == 0 else theirs, torch.device("cpu"))
        assert got == want, (rank, mine, theirs, got)
