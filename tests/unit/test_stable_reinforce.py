"""``stable_reinforce`` at the engine level (fp32): the sampler's stability record, the datum's
provenance resolved against it, and the loss, logprobs and LoRA gradients against the float64
formula of ``shared/spec/stability.md`` on the logits of a PEFT reference model."""

import copy

import numpy as np
import pytest
import torch

from ember.core.adapters import LoraConfig
from ember.engine.stability import StabilityRecord, StabilityStore, resolve_datum
from ember.engine.worker import Worker
from ember.types import Datum, ForwardBackwardInput, InvalidRequest, SampleInput, SamplingParams
from tests import stability_reference as ref
from tests.lora_helpers import peft_grads_as_ember, peft_model_like, randomise

SESSION = "session-a"
PROMPTS = [[5, 17, 3, 99, 41, 7], [250, 11, 64]]


def sample_and_record(worker, slot, params, store, num_samples=3, prompts=PROMPTS):
    """Sample ``prompts`` with a stability record each; returns [(prompt, sequence, sequence_id)]."""
    out = []
    for p_i, prompt in enumerate(prompts):
        inp = SampleInput(slot=slot, prompt=np.array(prompt), params=params, num_samples=num_samples,
                          record_stability=True)
        (res,) = worker.sample([inp])
        for i, seq in enumerate(res.sequences):
            sid = f"req{p_i}-{params.seed}:{i}"
            store.put(sid, StabilityRecord.of_sample(SESSION, "sampler-1", inp, seq, res.routing_layers))
            out.append((np.array(prompt), seq, sid))
    return out


def cookbook_datum(prompt, seq, sid, advantage):
    """The datum and spans tinker-cookbook's ``with_sampled_provenance`` builds (``rl_loop``)."""
    P, G = len(prompt), len(seq.tokens)
    tokens = np.concatenate([prompt, seq.tokens[:-1]])
    targets = np.concatenate([prompt[1:], seq.tokens])
    adv = np.concatenate([np.zeros(P - 1), np.full(G, advantage)]).astype(np.float32)
    lp = np.concatenate([np.zeros(P - 1), seq.logprobs]).astype(np.float32)
    datum = Datum(tokens, {"target_tokens": targets, "advantages": adv, "logprobs": lp})
    inputs = [("prompt", sid, 0, P), ("sampled", sid, 0, G - 1)]
    targets_spans = [("prompt", sid, 1, P - 1), ("sampled", sid, 0, G)]
    return datum, inputs, targets_spans


def reference_rows(store, datum, sid, P):
    """The record's support at each sampled target position, for the float64 reference."""
    rec = store.get(sid, SESSION)
    rows = {}
    for g in range(rec.tokens.size):
        k = rec.ids[g] >= 0
        rows[P - 1 + g] = {"ids": rec.ids[g][k], "q": rec.q[g][k].astype(np.float64),
                           "temperature": rec.temperature, "truncated": rec.truncated, "logq_y": rec.logprob[g]}
    return rows


def check_against_reference(reference, datums, rows, out, config) -> torch.Tensor:
    """The float64 formula on ``reference``'s logits: each datum's logprobs equal ``out``'s, and the
    summed loss its ``loss:sum``; returns that loss (for its gradients)."""
    total = 0.0
    for d, r, lp in zip(datums, rows, out.logprobs):
        logits = reference(torch.tensor([d.tokens.tolist()])).logits[0]
        loss, logprobs = ref.loss(logits, d.loss_inputs["target_tokens"], r, d.loss_inputs["advantages"], **config)
        np.testing.assert_allclose(lp, logprobs.detach().numpy(), atol=1e-5, rtol=0)
        total = total + loss
    assert out.metrics["loss:sum"] == pytest.approx(float(total.detach()), rel=1e-5, abs=1e-5)
    return total


CASES = [
    ("truncated", SamplingParams(max_tokens=7, temperature=0.8, top_k=12, top_p=0.9, seed=1), {}),
    ("untruncated", SamplingParams(max_tokens=7, temperature=1.0, seed=2), {}),
    ("untruncated-tempered", SamplingParams(max_tokens=7, temperature=0.7, seed=3), {}),
    ("truncated-tis-kl", SamplingParams(max_tokens=7, temperature=1.2, top_k=20, seed=4),
     {"tis_cap": 1.5, "kl_coeff": 0.3}),
    ("untruncated-tis-kl", SamplingParams(max_tokens=7, temperature=0.9, seed=5), {"tis_cap": 1.2, "kl_coeff": 0.2}),
]


@pytest.mark.parametrize("name,params,config", CASES, ids=[c[0] for c in CASES])
def test_loss_logprobs_and_gradients_equal_the_float64_formula(name, params, config, hf_models):
    hf, path = hf_models["qwen3"]
    worker = Worker.from_pretrained(path, "cpu", torch.float32)
    slot = worker.create_adapter(LoraConfig(rank=4, alpha=8.0, seed=5))
    adapter = worker.adapter(slot)
    randomise(adapter, seed=11, scale=0.1)
    store = StabilityStore()
    samples = sample_and_record(worker, slot, params, store)
    rng = np.random.default_rng(0)
    advantages = rng.normal(0, 1, len(samples))
    datums, rows = [], []
    for (prompt, seq, sid), a in zip(samples, advantages):
        d, ins, outs = cookbook_datum(prompt, seq, sid, a)
        datums.append(resolve_datum(store, SESSION, d, ins, outs, "data"))
        rows.append(reference_rows(store, d, sid, len(prompt)))
    assert all(d.support.kind.max() == (1 if "untruncated" not in name else 2) for d in datums)
    (out,) = worker.forward_backward([ForwardBackwardInput(slot, datums, "stable_reinforce", config)])

    peft = peft_model_like(copy.deepcopy(hf), adapter).double()
    check_against_reference(peft, datums, rows, out, config).backward()
    ref_grads, mine = peft_grads_as_ember(peft, adapter), adapter.grads()
    assert set(ref_grads) == set(mine)
    for k, g in ref_grads.items():
        err = (mine[k].double() - g).norm() / g.norm().clamp_min(1e-12)
        assert err < 1e-5, (k, float(err))
    # the sampler and the replaying trainer agree on the sampled tokens (same weights, fp32)
    assert out.metrics["stability/gap:mean"] < 1e-5
    assert out.metrics["stability/tokens:sum"] == sum(len(s.tokens) for _, s, _ in samples)
    if "untruncated" in name:
        assert 0 < out.metrics["stability/sampler_mass:mean"] < 1
    else:
        assert 0 < out.metrics["stability/trainer_mass:mean"] < 1  # truncation really cut the distribution


def test_a_full_finetuning_run_equals_the_float64_formula(hf_models, tmp_path):
    """stable_reinforce on a rank-0 run (every weight trains): a sampler of the run's weights
    records the samples' stability, and its loss, logprobs and every weight's gradient equal the float64
    formula on transformers' logits."""
    from tests.parity.test_full_gradients import assert_full_gradients_equal, grads_in_ember_layout

    hf, path = hf_models["qwen3"]
    worker = Worker.from_pretrained(path, "cpu", torch.float32, full_finetune=True, activation_checkpointing="off")
    slot = worker.create_adapter(LoraConfig(rank=0))
    store = StabilityStore()
    _, params, config = CASES[3]  # truncated, with TIS and KL
    samples = sample_and_record(worker, worker.snapshot_adapter(slot), params, store)  # its sampler
    datums, rows = [], []
    for (prompt, seq, sid), a in zip(samples, np.random.default_rng(1).normal(0, 1, len(samples))):
        d, ins, outs = cookbook_datum(prompt, seq, sid, a)
        datums.append(resolve_datum(store, SESSION, d, ins, outs, "data"))
        rows.append(reference_rows(store, d, sid, len(prompt)))
    (out,) = worker.forward_backward([ForwardBackwardInput(slot, datums, "stable_reinforce", config)])

    reference = copy.deepcopy(hf).double()
    check_against_reference(reference, datums, rows, out, config).backward()
    assert out.metrics["stability/gap:mean"] < 1e-5
    assert_full_gradients_equal(worker.full.get(slot).model, grads_in_ember_layout(reference, tmp_path))
    assert all(p.grad is None for p in worker.model.parameters())  # the shared base model is untouched


def test_replay_matters_for_truncated_sampling(hf_models):
    """The returned logprob is log p_S (renormalised over the kept set), not the full-vocabulary
    logprob the plain losses use: they differ by log of the kept mass."""
    _, path = hf_models["qwen3"]
    worker = Worker.from_pretrained(path, "cpu", torch.float32)
    slot = worker.create_adapter(LoraConfig(rank=4))
    store = StabilityStore()
    params = SamplingParams(max_tokens=6, temperature=1.0, top_k=5, seed=9)
    samples = sample_and_record(worker, slot, params, store, num_samples=2)
    datums = [resolve_datum(store, SESSION, *cookbook_datum(p, s, sid, 1.0), "data") for p, s, sid in samples]
    (out,) = worker.forward_backward([ForwardBackwardInput(slot, datums, "stable_reinforce", {})])
    for (prompt, seq, sid), lp in zip(samples, out.logprobs):
        rec = store.get(sid, SESSION)
        sampled = lp[len(prompt) - 1 :]
        np.testing.assert_allclose(sampled, seq.logprobs - np.log(rec.mass), atol=1e-5)
        assert (sampled - seq.logprobs > 1e-3).all()


def test_mixed_pass_gives_each_request_what_it_gets_alone(hf_models):
    """A stable_reinforce request packed beside another adapter's cross_entropy request."""
    _, path = hf_models["qwen3_moe"]
    worker = Worker.from_pretrained(path, "cpu", torch.float32)
    a = worker.create_adapter(LoraConfig(rank=4, seed=1))
    b = worker.create_adapter(LoraConfig(rank=4, seed=2))
    randomise(worker.adapter(a), seed=3, scale=0.1)
    randomise(worker.adapter(b), seed=4, scale=0.1)
    store = StabilityStore()
    samples = sample_and_record(worker, a, SamplingParams(max_tokens=6, temperature=0.9, top_k=16, seed=3), store)
    sr = ForwardBackwardInput(a, [resolve_datum(store, SESSION, *cookbook_datum(p, s, sid, 0.5 - i % 2), "data")
                                  for i, (p, s, sid) in enumerate(samples)], "stable_reinforce", {})
    seq = np.arange(40, 70)
    ce = ForwardBackwardInput(b, [Datum(seq[:-1], {"target_tokens": seq[1:], "weights": np.ones(29, np.float32)})])

    def run(reqs):
        for s in (a, b):
            worker.adapter(s).flat.grad = None
        outs = worker.forward_backward(reqs)
        return outs, {s: {k: g.clone() for k, g in (worker.adapter(s).grads() or {}).items()} for s in (a, b)}

    (sr_alone,), g_sr = run([sr])
    (ce_alone,), g_ce = run([ce])
    (sr_mixed, ce_mixed), g_mixed = run([sr, ce])
    for alone, mixed in ((sr_alone, sr_mixed), (ce_alone, ce_mixed)):
        assert mixed.metrics["loss:sum"] == pytest.approx(alone.metrics["loss:sum"], rel=1e-5, abs=1e-6)
        for x, y in zip(alone.logprobs, mixed.logprobs):
            np.testing.assert_allclose(x, y, atol=1e-5)
    assert sr_mixed.metrics["stability/route_flips:mean"] == sr_alone.metrics["stability/route_flips:mean"]
    assert "stability/route_flips:mean" not in ce_mixed.metrics
    for slot, alone in ((a, g_sr[a]), (b, g_ce[b])):
        for k, g in alone.items():
            assert (g_mixed[slot][k] - g).norm() <= 1e-5 * g.norm(), k


def test_bad_provenance_is_refused_with_the_span_named(hf_models):
    _, path = hf_models["qwen3"]
    worker = Worker.from_pretrained(path, "cpu", torch.float32)
    slot = worker.create_adapter(LoraConfig(rank=4))
    store = StabilityStore()
    ((prompt, seq, sid),) = sample_and_record(worker, slot, SamplingParams(max_tokens=5, seed=1), store,
                                             num_samples=1, prompts=PROMPTS[:1])
    d, ins, outs = cookbook_datum(prompt, seq, sid, 1.0)
    with pytest.raises(InvalidRequest, match="no stability record in this session"):
        resolve_datum(store, "another-session", d, ins, outs, "data[0]")
    with pytest.raises(InvalidRequest, match="no stability record"):
        resolve_datum(store, SESSION, d, [("prompt", "nope:0", 0, len(prompt)), *ins[1:]], outs, "data[0]")
    wrong = Datum(d.tokens.copy(), dict(d.loss_inputs))
    wrong.tokens[2] = (wrong.tokens[2] + 1) % 320
    with pytest.raises(InvalidRequest, match=r"model_input_spans\[0\]: model input token .* differs from prompt 2"):
        resolve_datum(store, SESSION, wrong, ins, outs, "data[0]")
    with pytest.raises(InvalidRequest, match="beyond the record's 5 sampled tokens"):
        resolve_datum(store, SESSION, d, ins, [outs[0], ("sampled", sid, 1, len(seq.tokens))], "data[0]")
    with pytest.raises(InvalidRequest, match="spans cover"):
        resolve_datum(store, SESSION, d, ins[:1], outs, "data[0]")
    (res,) = worker.forward_backward([ForwardBackwardInput(slot, [d], "stable_reinforce", {})])
    assert "provenance" in res.message


def _family_model(family: str, tmp_path):
    from tests.parity import test_deepseek_v3, test_inkling2, test_qwen3_next, test_qwen4_exp
    from tests.tiny_models import build_hf_model

    ds = test_deepseek_v3.CASES
    build = {"qwen3_moe": lambda: build_hf_model("qwen3_moe"),
             "deepseek_v3": lambda: test_deepseek_v3.build_hf("deepseek_v3", **ds["deepseek_yarn"][1]),
             "glm4_moe_lite": lambda: test_deepseek_v3.build_hf("glm4_moe_lite", **ds["glm4_moe_lite"][1]),
             "qwen3_next": test_qwen3_next.build_hf, "qwen4_exp": test_qwen4_exp.build_hf,
             "inkling2": test_inkling2.build_hf_inkling2}[family]
    path = tmp_path / family
    build().save_pretrained(str(path))
    return path


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "glm4_moe_lite", "qwen3_next", "qwen4_exp", "inkling2"])
def test_every_moe_family_records_routes_and_replays_them(family, tmp_path):
    """The record holds each MoE layer's experts for every prompt and generated token, and the
    trainer, replaying them over the recorded support, reproduces the sampler's logprobs."""
    worker = Worker.from_pretrained(_family_model(family, tmp_path), "cpu", torch.float32)
    slot = worker.create_adapter(LoraConfig(rank=4, seed=2))
    randomise(worker.adapter(slot), seed=5, scale=0.05)
    store = StabilityStore()
    layers = sorted(worker.model.moe_routers())
    assert layers
    samples = sample_and_record(worker, slot, SamplingParams(max_tokens=8, temperature=0.9, top_k=24, seed=6), store,
                                num_samples=2, prompts=[[5, 17, 3, 99, 41, 7, 8, 200, 13, 14, 15, 16]])
    for prompt, seq, sid in samples:
        rec = store.get(sid, SESSION)
        top_k = next(iter(worker.model.moe_routers().values())).top_k
        assert rec.route_layers == tuple(layers)
        assert rec.routes.shape == (len(prompt) + len(seq.tokens) - 1, len(layers), top_k)
    datums = [resolve_datum(store, SESSION, *cookbook_datum(p, s, sid, 1.0), "data") for p, s, sid in samples]
    (out,) = worker.forward_backward([ForwardBackwardInput(slot, datums, "stable_reinforce", {})])
    assert out.metrics["stability/gap:mean"] < 1e-4, out.metrics
    assert out.metrics["stability/route_flips:mean"] < 0.05, out.metrics  # same weights: ~no flips
    assert worker.adapter(slot).flat.grad.norm() > 0


def test_static_decoder_records_the_same_support_as_the_eager_one(hf_models):
    """The static (CUDA-graph) decoder computes the head of untruncated rows inside its step
    (``head_record``); it must record what the eager path records, for plain, tempered, greedy and
    truncated rows sampled together."""
    from ember.core.sampling import SamplerConfig

    _, path = hf_models["qwen3"]
    out = []
    for static in (False, True):
        cfg = SamplerConfig(max_seqs=16, page_size=4, kv_tokens=1024, static_decode=static)
        worker = Worker.from_pretrained(path, "cpu", torch.float32, sampler_config=cfg)
        slot = worker.create_adapter(LoraConfig(rank=4, seed=1))
        randomise(worker.adapter(slot), seed=2, scale=0.1)
        params = [SamplingParams(max_tokens=6, temperature=1.0, seed=1, stop=[]),
                  SamplingParams(max_tokens=6, temperature=0.6, seed=2, stop=[]),
                  SamplingParams(max_tokens=6, temperature=0.0, seed=3, stop=[]),
                  SamplingParams(max_tokens=6, temperature=0.9, top_k=10, seed=4, stop=[])]
        inputs = [SampleInput(slot=slot, prompt=np.array(p), params=sp, num_samples=2, record_stability=True)
                  for p, sp in zip([[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]], params)]
        out.append(worker.sample(inputs))
        assert (worker.sampler.static is not None) == static
    for a, b in zip(*out):
        for x, y in zip(a.sequences, b.sequences):
            np.testing.assert_array_equal(x.tokens, y.tokens)
            assert x.support.truncated == y.support.truncated
            np.testing.assert_array_equal(x.support.ids, y.support.ids)
            np.testing.assert_allclose(x.support.q, y.support.q, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(x.support.logprob, y.support.logprob, atol=1e-5)
            np.testing.assert_allclose(x.support.mass, y.support.mass, atol=1e-5)
