"""Stage 5b: ``stable_reinforce`` through the official SDK, as tinker-cookbook uses it.

A sampling client made with ``record_stability_info=True`` returns a ``sequence_id`` per sample;
datums built as the cookbook's ``rl_loop`` builds them (prompt targets padded with 0, its own
``with_sampled_provenance``) train with
``forward_backward(data, "stable_reinforce")``. The loss and returned logprobs are checked against
the float64 formula (``tests/stability_reference.py``) on transformers' logits of the same weights
(a fresh adapter is the base model), with the kept set recomputed from those logits. Then a sampler
made from a checkpoint, and the bad inputs of the spec: no provenance (400), unknown and another
key's sequence_id, span tokens that differ from the record, offsets beyond it (failed futures), and
a truncated recording with too large a top_k (400); the client keeps working."""

import numpy as np
import tinker
import torch
from tinker import types
from tinker_cookbook.recipes.rl_loop import with_sampled_provenance

from tests import stability_reference as ref
from tests.conformance.scenarios.common import CONF, MOE, arr, check_metric_keys, hf_model

HEAD = 64  # the server's K_head for untruncated sampling (ember.lossdefs.STABILITY_HEAD)
sc = tinker.ServiceClient()
tc = sc.create_lora_training_client(base_model=MOE, rank=8, seed=3).result()
sampler = tc.save_weights_and_get_sampling_client(record_stability_info=True)
prompt = types.ModelInput.from_ints([5, 17, 42, 9, 300, 71])
P = prompt.length
cases = [types.SamplingParams(max_tokens=6, temperature=0.8, top_k=16, seed=1, stop=[]),
         types.SamplingParams(max_tokens=6, temperature=1.0, seed=2, stop=[]),
         types.SamplingParams(max_tokens=5, temperature=1.1, top_k=40, top_p=0.9, seed=3, stop=[])]
samples = []  # (params, sequence)
for params in cases:
    for seq in sampler.sample(prompt, num_samples=2, sampling_params=params).result().sequences:
        samples.append((params, seq))
ids = [s.sequence_id for _, s in samples]
assert all(isinstance(i, str) and i for i in ids) and len(set(ids)) == len(ids), ids

rng = np.random.default_rng(0)
advantages = rng.normal(0, 1, len(samples))


def datum_of(seq, advantage):
    """The datum tinker-cookbook's rl_loop builds, with its provenance."""
    ob_len = P - 1
    d = types.Datum(model_input=prompt.append(types.EncodedTextChunk(tokens=seq.tokens[:-1])),
                    loss_fn_inputs={"target_tokens": [0] * ob_len + seq.tokens,
                                    "logprobs": [0.0] * ob_len + seq.logprobs,
                                    "advantages": [0.0] * ob_len + [advantage] * len(seq.tokens)})
    return with_sampled_provenance(d, P, len(seq.tokens), seq.sequence_id)


# tinker-cookbook pads the prompt's targets with 0; they lie under prompt spans and carry no term.
data = [datum_of(s, a) for (_, s), a in zip(samples, advantages)]
out = tc.forward_backward(data, "stable_reinforce").result()
check_metric_keys(out.metrics)

total = 0.0
model = hf_model(MOE)  # fp32 (its grouped expert kernel has no float64); the formula runs in float64
for (params, seq), d, o in zip(samples, data, out.loss_fn_outputs):
    tokens = d.model_input.to_ints()
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].double()
    targets = np.asarray(d.loss_fn_inputs["target_tokens"].to_numpy())
    rows = {}
    truncated = params.top_k > 0 or params.top_p < 1
    for g in range(len(seq.tokens)):
        z = logits[P - 1 + g].numpy()
        if truncated:
            kept, q = ref.kept_set(z, params.temperature, params.top_k, params.top_p)
        else:
            full = np.exp(z / params.temperature - np.logaddexp.reduce(z / params.temperature))
            kept = np.argsort(-full, kind="stable")[:HEAD]
            q = full[kept]
        assert targets[P - 1 + g] in kept or not truncated  # the sampled token is in its kept set
        logq = np.log(q[list(kept).index(targets[P - 1 + g])]) if truncated else 0.0
        rows[P - 1 + g] = {"ids": kept, "q": q, "temperature": params.temperature, "truncated": truncated,
                           "logq_y": logq}
    adv = np.asarray(d.loss_fn_inputs["advantages"].to_numpy(), np.float64)
    loss, lps = ref.loss(logits, targets, rows, adv)
    np.testing.assert_allclose(arr(o["logprobs"]), lps.numpy(), atol=2e-4)
    total += float(loss)
assert abs(out.metrics["loss:sum"] - total) < 1e-3 * max(1.0, abs(total)), (out.metrics, total)
assert out.metrics["stability/gap:mean"] < 1e-4, out.metrics
assert out.metrics["stability/route_flips:mean"] < 0.05, out.metrics  # same weights: R3 changes ~nothing
assert tc.optim_step(types.AdamParams(learning_rate=1e-3)).result().metrics["grad_norm"] > 0
print("stable_reinforce matches its formula", out.metrics)

# A sampler made from a checkpoint records too; the trainer has these weights, so the gap is ~0.
ckpt = tc.save_weights_for_sampler("sr-ckpt").result().path
from_ckpt = sc.create_sampling_client(model_path=ckpt, record_stability_info=True)
seq = from_ckpt.sample(prompt, 1, cases[0]).result().sequences[0]
d = datum_of(seq, 1.0)
res = tc.forward_backward([d], "stable_reinforce").result()
assert res.metrics["stability/gap:mean"] < 1e-4, res.metrics
tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
good = d

# Bad input: each a clear error that names the problem; the client keeps working.
try:
    tc.forward_backward([types.Datum(model_input=d.model_input, loss_fn_inputs=d.loss_fn_inputs)],
                        "stable_reinforce").result()
    raise AssertionError("stable_reinforce without provenance must fail")
except tinker.BadRequestError as e:
    assert "provenance" in str(e), e


def respan(datum, sid=None, offset=None):
    """``datum`` whose spans name ``sid`` instead, or whose sampled target span starts at ``offset``."""
    ins = [type(s)(sequence_id=sid or s.sequence_id, offset=s.offset, length=s.length) for s in datum.model_input_spans]
    outs = [type(s)(sequence_id=sid or s.sequence_id, offset=s.offset, length=s.length) for s in datum.loss_fn_input_spans]
    if offset is not None:
        outs[-1] = types.SampledProvenanceSpan(sequence_id=outs[-1].sequence_id, offset=offset, length=outs[-1].length)
    return types.Datum(model_input=datum.model_input, loss_fn_inputs=datum.loss_fn_inputs,
                       model_input_spans=ins, loss_fn_input_spans=outs)


bob = tinker.ServiceClient(api_key=CONF["keys"]["bob"])
bob_tc = bob.create_lora_training_client(base_model=MOE, rank=8, seed=4).result()
bob_seq = bob_tc.save_weights_and_get_sampling_client(record_stability_info=True).sample(
    prompt, 1, cases[0]).result().sequences[0]
for bad, why in [(respan(good, sid="no-such-request:0"), "no stability record"),
                 (respan(good, sid=bob_seq.sequence_id), "no stability record in this session"),
                 (respan(good, offset=2), "beyond the record"),
                 (types.Datum(model_input=types.ModelInput.from_ints([1] + good.model_input.to_ints()[1:]),
                              loss_fn_inputs=good.loss_fn_inputs, model_input_spans=good.model_input_spans,
                              loss_fn_input_spans=good.loss_fn_input_spans), "differs from prompt 0")]:
    try:
        tc.forward_backward([bad], "stable_reinforce").result()
        raise AssertionError(f"must fail: {why}")
    except tinker.RequestFailedError as e:
        assert why in str(e), (why, str(e))
try:
    sampler.sample(prompt, 1, types.SamplingParams(max_tokens=2, top_k=1000, top_p=0.9)).result()
    raise AssertionError("a truncated recording beyond the support cap must fail")
except tinker.BadRequestError as e:
    assert "top_k" in str(e), e
assert tc.forward_backward([good], "stable_reinforce").result().metrics["stability/tokens:sum"] == len(seq.tokens)
bob.close("success").result()
sc.close("success").result()
print("stage 5b ok")
