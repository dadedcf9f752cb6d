"""Stage 7: sampling. Samplers from a snapshot (save_weights_and_get_sampling_client), a named
sampler checkpoint and the base model. Judges: the trainer's forward logprobs of the same tokens
(and transformers for the base model), greedy = top-1, seeds reproduce, every stop form, prompt /
top-k / target prompt logprobs, and a snapshot keeps its weights while training goes on."""

import numpy as np
import tinker
import torch
from tinker import types

from tests.conformance.scenarios.common import QWEN3, arr, random_datum, reference_logprobs

rng = np.random.default_rng(7)
sc = tinker.ServiceClient()
tc = sc.create_lora_training_client(base_model=QWEN3, rank=8, seed=7).result()
tok = tc.get_tokenizer()
data = [random_datum(rng, n) for n in (12, 9)]
for _ in range(2):
    tc.forward_backward(data, "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=2e-2))
snap = tc.save_weights_and_get_sampling_client().result()
prompt_ids = tok.encode("User: what is a learning rate?")
prompt = types.ModelInput.from_ints(prompt_ids)


def trainer_logprobs(tokens: list[int]) -> np.ndarray:
    d = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:]})
    return arr(tc.forward([d], "cross_entropy").result().loss_fn_outputs[0]["logprobs"])


# num_samples, unique sequence ids, stop=[] runs to max_tokens, logprobs = the trainer's
res = snap.sample(prompt, 3, types.SamplingParams(max_tokens=8, temperature=1.0, seed=1, stop=[])).result()
assert len(res.sequences) == 3 and len({s.sequence_id for s in res.sequences}) == 3
for s in res.sequences:
    assert s.stop_reason == "length" and len(s.tokens) == 8 and len(s.logprobs) == 8
    ref = trainer_logprobs(prompt_ids + s.tokens)[len(prompt_ids) - 1:]
    np.testing.assert_allclose(s.logprobs, ref, atol=2e-4)
again = snap.sample(prompt, 3, types.SamplingParams(max_tokens=8, temperature=1.0, seed=1, stop=[])).result()
assert [s.tokens for s in again.sequences] == [s.tokens for s in res.sequences], "same seed, same samples"
other = snap.sample(prompt, 3, types.SamplingParams(max_tokens=8, temperature=1.0, seed=2, stop=[])).result()
assert [s.tokens for s in other.sequences] != [s.tokens for s in res.sequences]

# greedy with top-k sample logprobs: each token is the top-1
g = snap.sample(prompt, 1, types.SamplingParams(max_tokens=6, temperature=0.0, stop=[]), topk_sample_logprobs=3).result()
seq = g.sequences[0]
for t, lp, top in zip(seq.tokens, seq.logprobs, seq.topk_logprobs):
    assert top[0][0] == t and abs(top[0][1] - lp) < 1e-4 and top[0][1] >= top[1][1] >= top[2][1]

# stop forms: a token id list, a string, None (EOS only)
first = seq.tokens[0]
by_id = snap.sample(prompt, 1, types.SamplingParams(max_tokens=6, temperature=0.0, stop=[first])).result().sequences[0]
assert by_id.stop_reason == "stop" and by_id.tokens == [first]
text = tok.decode(seq.tokens[:2])
by_str = snap.sample(prompt, 1, types.SamplingParams(max_tokens=6, temperature=0.0, stop=[text])).result().sequences[0]
assert by_str.stop_reason == "stop" and by_str.tokens == seq.tokens[:2], (by_str.tokens, seq.tokens, text)
eos = snap.sample(prompt, 2, types.SamplingParams(max_tokens=5, seed=3)).result()
for s in eos.sequences:
    assert (s.stop_reason == "stop") == (s.tokens[-1] == tok.eos_token_id) and len(s.tokens) <= 5

# prompt logprobs (NaN/None at 0), top-k prompt logprobs, compute_logprobs, last_n
p = snap.sample(prompt, 1, types.SamplingParams(max_tokens=1), include_prompt_logprobs=True,
                topk_prompt_logprobs=3).result()
ref = trainer_logprobs(prompt_ids)
assert p.prompt_logprobs[0] is None
np.testing.assert_allclose(p.prompt_logprobs[1:], ref, atol=2e-4)
assert all(top is not None and len(top) == 3 for top in p.topk_prompt_logprobs[1:])
lps = snap.compute_logprobs(prompt).result()
np.testing.assert_allclose(lps[1:], ref, atol=2e-4)
tail = snap.compute_logprobs(prompt, prompt_logprobs_last_n=3).result()
assert all(x is None for x in tail[:-3]) and np.allclose(tail[-3:], ref[-3:], atol=2e-4)

# target prompt logprobs, dense and sparse CSR (unlisted cells = not requested)
P = len(prompt_ids)
targets = torch.full((P - 1, 2), -1, dtype=torch.long)
targets[:, 0] = torch.tensor(prompt_ids[1:])
targets[2, 1] = 5
for td in (types.TensorData.from_torch(targets), types.TensorData.from_torch_sparse(targets, pad_value=-1)):
    r = snap.sample(prompt, 1, types.SamplingParams(max_tokens=1), target_prompt_logprobs=td).result()
    got = r.target_prompt_logprobs.to_numpy()
    assert got.shape == (P - 1, 2)
    np.testing.assert_allclose(got[:, 0], ref, atol=2e-4)

# prompt alternatives: k draws per prompt position with the model's logprobs of them
alt = snap.sample(prompt, 1, types.SamplingParams(max_tokens=1, temperature=0.0), prompt_alt_tokens_k=2,
                  topk_prompt_logprobs=1).result().prompt_alt_tokens
alt_ids, alt_lps = alt.tokens.to_numpy(), alt.logprobs.to_numpy()
assert alt_ids.shape == alt_lps.shape == (P - 1, 2)
assert (alt_ids == np.array([[t[0][0]] * 2 for t in p.topk_prompt_logprobs[1:]])).all()  # greedy: the top token
hot = snap.sample(prompt, 1, types.SamplingParams(max_tokens=1, seed=5), prompt_alt_tokens_k=2).result().prompt_alt_tokens
scored = snap.sample(prompt, 1, types.SamplingParams(max_tokens=1), target_prompt_logprobs=hot.tokens).result()
np.testing.assert_allclose(hot.logprobs.to_numpy(), scored.target_prompt_logprobs.to_numpy(), atol=2e-4)

# a named sampler checkpoint (GET /samplers/{id}) has the same weights; the base model sampler
path = tc.save_weights_for_sampler("sw1").result().path
named = sc.create_sampling_client(model_path=path)
np.testing.assert_allclose(named.compute_logprobs(prompt).result()[1:], ref, atol=2e-4)
base = sc.create_sampling_client(base_model=QWEN3)
np.testing.assert_allclose(base.compute_logprobs(prompt).result()[1:],
                           reference_logprobs(QWEN3, prompt_ids[:-1], prompt_ids[1:]), atol=2e-4)

# training goes on: the old snapshot keeps its weights, a new one sees the new weights
tc.forward_backward(data, "cross_entropy")
tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
np.testing.assert_allclose(snap.compute_logprobs(prompt).result()[1:], ref, atol=2e-4)
new_ref = trainer_logprobs(prompt_ids)
assert np.abs(new_ref - ref).max() > 1e-3
snap2 = tc.save_weights_and_get_sampling_client().result()
np.testing.assert_allclose(snap2.compute_logprobs(prompt).result()[1:], new_ref, atol=2e-4)

# bad sampling input is a 400 with a body
try:
    snap.sample(types.ModelInput.from_ints([10**6]), 1, types.SamplingParams(max_tokens=2)).result()
    raise AssertionError("token ids beyond the vocabulary must fail")
except tinker.BadRequestError as e:
    assert "prompt token ids" in str(e)
sc.close("success").result()
print("stage 7 ok")
