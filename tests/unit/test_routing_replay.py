"""MoE routing can be recorded and replayed (rollout routing replay, R3)."""

import torch

from ember.core.batch import pack
from ember.core.layers.attention import PackedAttention
from ember.core.loading import load_model
from ember.core.logprobs import token_logprobs
from ember.core.models.base import ForwardContext, RoutingRecord
from tests.tiny_models import random_sequences


def _logprobs(model, batch, routing):
    attn = PackedAttention(batch.doc_lengths, torch.device("cpu"))
    ctx = ForwardContext(batch.positions, lambda i, q, k, v, s, sc: attn(q, k, v, s, sc),
                         seq_lens=batch.doc_lengths, routing=routing)
    with torch.no_grad():
        h = model.hidden_states(batch.input_ids, ctx)
        return token_logprobs(h, model.unembed_weight, torch.roll(batch.input_ids, -1))


def test_record_and_replay(hf_models):
    _, path = hf_models["qwen3_moe"]
    model = load_model(path, "cpu", torch.float32)
    batch = pack(random_sequences(320, [12, 20], seed=3), [0, 0], "cpu")
    rec = RoutingRecord(record={})
    base = _logprobs(model, batch, rec)
    assert sorted(rec.record) == [0, 1] and rec.record[0].shape == (32, 2)
    same = _logprobs(model, batch, RoutingRecord(replay=rec.record))
    torch.testing.assert_close(same, base, atol=0, rtol=0)
    # replaying other experts changes the output: the replayed choice is really used
    other = {k: (v + 1) % 8 for k, v in rec.record.items()}
    changed = _logprobs(model, batch, RoutingRecord(replay=other))
    assert (changed - base).abs().max() > 1e-3


def test_partial_replay_routes_unrecorded_rows_live_and_reports_flips(hf_models):
    """Rows of -1 in a replay use the live router; ``reference`` + ``flips`` mark the tokens whose
    live routing differs from the recorded one."""
    _, path = hf_models["qwen3_moe"]
    model = load_model(path, "cpu", torch.float32)
    batch = pack(random_sequences(320, [12, 20], seed=3), [0, 0], "cpu")
    rec = RoutingRecord(record={})
    base = _logprobs(model, batch, rec)
    other = {k: (v + 1) % 8 for k, v in rec.record.items()}
    half = {k: torch.where(torch.arange(32)[:, None] < 12, v, -1) for k, v in other.items()}  # first sequence only
    flips = RoutingRecord(replay=half, reference=half, flips={})
    mixed = _logprobs(model, batch, flips)
    assert (mixed[:12] - base[:12]).abs().max() > 1e-3  # replayed: other experts
    # the second sequence routes live, exactly as without a replay (packed documents do not mix)
    torch.testing.assert_close(mixed[12:], base[12:], atol=1e-5, rtol=0)
    for f in flips.flips.values():
        assert f[:12].all() and not f[12:].any()  # (v + 1) % 8 is never the live choice


def _tied_router_model(tmp_path):
    """A tiny Qwen3-MoE whose router rows come in exactly tied groups (experts 0-2, 3-5, 6-7), so
    which expert of a group a token gets rests on how a tie is broken: a perturbation of the
    router far below the logprob tolerance moves the routing of many tokens."""
    from tests.tiny_models import build_hf_model, save_hf_model

    hf = build_hf_model("qwen3_moe")
    with torch.no_grad():
        for layer in hf.model.layers:
            w = layer.mlp.gate.weight
            for group in ((0, 1, 2), (3, 4, 5), (6, 7)):
                w[list(group)] = w[group[0]].clone()
    return save_hf_model(hf, tmp_path / "tied")


def test_r3_replays_the_sampler_experts_after_the_router_drifts(tmp_path):
    """Rollout routing replay, end to end through the stability record: sample (recording routes),
    then make the live router choose other experts for many tokens while leaving everything else
    as the sampler saw it, then train with stable_reinforce. With replay the trainer's logprob of
    every sampled token equals the sampler's (1e-5); without it (``routing_replay=0``) it does not.

    Why a router perturbation and not an optim_step: with LoRA the router is frozen, so a step that
    changes which experts the live router picks (through the adapter's attention factors) changes
    the logprobs by far more than the routing does; only a change that touches routing alone can
    show that replay recovers the sampler's numbers. The next test takes a real optim_step."""
    import numpy as np

    from ember.core.adapters import LoraConfig
    from ember.engine.stability import StabilityStore, resolve_datum
    from ember.engine.worker import Worker
    from ember.types import ForwardBackwardInput, SamplingParams
    from tests.unit.test_stable_reinforce import SESSION, cookbook_datum, sample_and_record

    worker = Worker.from_pretrained(_tied_router_model(tmp_path), "cpu", torch.float32)
    slot = worker.create_adapter(LoraConfig(rank=4))
    store = StabilityStore()
    samples = sample_and_record(worker, slot, SamplingParams(max_tokens=8, temperature=1.0, seed=7), store)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for gate in worker.model.moe_routers().values():
            gate.weight += 1e-7 * torch.randn(gate.weight.shape, generator=g)
    datums = [resolve_datum(store, SESSION, *cookbook_datum(p, s, sid, 1.0), "data") for p, s, sid in samples]

    def gap(replay: float):
        (out,) = worker.forward_backward([ForwardBackwardInput(slot, datums, "stable_reinforce",
                                                               {"routing_replay": replay}, forward_only=True)])
        diffs = [np.abs(lp[len(p) - 1 :] - s.logprobs).max() for (p, s, _), lp in zip(samples, out.logprobs)]
        return max(diffs), out.metrics

    replayed, m1 = gap(1.0)
    live, m0 = gap(0.0)
    # the live router drifted for many tokens (more without replay: earlier layers' flips compound)
    assert 0.1 < m1["stability/route_flips:mean"] <= m0["stability/route_flips:mean"]
    assert replayed < 1e-5, replayed
    assert live > 1e-3, live


def test_r3_after_an_optim_step_replays_and_counts_flips(hf_models):
    """A real optim_step between sampling and training: the live router then chooses other
    experts for some tokens (reported as route flips), and the replayed pass differs from the
    live one exactly there; gradients still reach the adapter through the replayed experts."""
    import numpy as np

    from ember.core.adapters import LoraConfig
    from ember.core.optim import AdamParams
    from ember.engine.stability import StabilityStore, resolve_datum
    from ember.engine.worker import Worker
    from ember.types import ForwardBackwardInput, SamplingParams
    from tests.unit.test_stable_reinforce import SESSION, cookbook_datum, sample_and_record

    _, path = hf_models["qwen3_moe"]
    worker = Worker.from_pretrained(path, "cpu", torch.float32)
    slot = worker.create_adapter(LoraConfig(rank=8, seed=1))
    store = StabilityStore()
    samples = sample_and_record(worker, slot, SamplingParams(max_tokens=8, temperature=1.0, seed=3), store)
    datums = [resolve_datum(store, SESSION, *cookbook_datum(p, s, sid, 1.0 - 2 * (i % 2)), "data")
              for i, (p, s, sid) in enumerate(samples)]
    (first,) = worker.forward_backward([ForwardBackwardInput(slot, datums, "stable_reinforce", {})])
    assert first.metrics["stability/route_flips:mean"] == 0  # same weights: the live router agrees
    worker.optim_step(slot, AdamParams(learning_rate=0.05))
    outs = {}
    for replay in (1.0, 0.0):
        (outs[replay],) = worker.forward_backward([ForwardBackwardInput(slot, datums, "stable_reinforce",
                                                                        {"routing_replay": replay})])
    flips = outs[1.0].metrics["stability/route_flips:mean"]
    assert flips > 0 and outs[0.0].metrics["stability/route_flips:mean"] > 0
    diff = max(np.abs(a - b).max() for a, b in zip(outs[1.0].logprobs, outs[0.0].logprobs))
    assert diff > 1e-4
    assert worker.adapter(slot).flat.grad.norm() > 0
