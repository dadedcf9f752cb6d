"""Full fine-tuning through the unmodified SDK (``create_lora_training_client(rank=0)`` on a server
started with ``--full-finetune``): every weight of the run's own copy of the model trains; the
run samples its current weights in the same engine; snapshots keep the weights they saw; state
resumes exactly with the optimizer; ``save_weights_external`` gives a whole Hugging Face model
that transformers loads with the trainer's logits; a LoRA tenant of the same base model is
unaffected to the bit; a LoRA checkpoint cannot be loaded into a full run (nor the reverse), and a
server without ``--full-finetune`` refuses rank 0."""

import tempfile
import urllib.request
from pathlib import Path

import numpy as np
import tinker
import torch
import transformers
from tinker import types

from tests.conformance.scenarios.common import CONF, QWEN3, arr, random_datum, reference_logprobs, tokens_of

sc = tinker.ServiceClient(display_name="full-finetune")
rc = sc.create_rest_client()
rng = np.random.default_rng(21)
adam = types.AdamParams(learning_rate=1e-3)
data = [random_datum(rng, n) for n in (12, 7, 16)]


def lps(tc, batch):
    return [arr(o["logprobs"]) for o in tc.forward(batch, "cross_entropy").result().loss_fn_outputs]


lora = sc.create_lora_training_client(base_model=QWEN3, rank=4, seed=5)
lora_before = lps(lora, data)

tc = sc.create_lora_training_client(base_model=QWEN3, rank=0)
info = tc.get_info()
assert info.model_data.model_name == QWEN3
assert rc.get_training_run(tc.model_id).result().is_lora is False

# step 0: the run's copy is the base model
for d, lp in zip(data, lps(tc, data)):
    np.testing.assert_allclose(lp, reference_logprobs(QWEN3, tokens_of(d), arr(d.loss_fn_inputs["target_tokens"])),
                               atol=2e-4, rtol=0)

# it trains (cross entropy, then an RL loss and a custom loss on the same run)
losses = []
for _ in range(4):
    fb = tc.forward_backward(data, "cross_entropy")
    tc.optim_step(adam).result()
    losses.append(fb.result().metrics["loss:sum"])
assert losses[-1] < losses[0] - 1.0, losses
rl = [types.Datum(model_input=d.model_input, loss_fn_inputs={
    "target_tokens": d.loss_fn_inputs["target_tokens"],
    "logprobs": (lp - 0.05).tolist(),
    "advantages": rng.normal(size=len(lp)).tolist()}) for d, lp in zip(data, lps(tc, data))]
out = tc.forward_backward(rl, "ppo").result()
assert np.isfinite(out.metrics["loss:sum"])


def custom(_data, logprobs_list):
    return sum((0.1 * lp**2 - lp).sum() for lp in logprobs_list), {}


assert len(tc.forward_backward_custom(data, custom).result().loss_fn_outputs) == len(data)
tc.optim_step(adam).result()

# the LoRA tenant of the same base model saw none of it
for a, b in zip(lps(lora, data), lora_before):
    assert np.array_equal(a, b)

# sampling the run's current weights: sampled tokens' logprobs are the trainer's
sampler = tc.save_weights_and_get_sampling_client()
prompt = types.ModelInput.from_ints(tokens_of(data[0]))
params = types.SamplingParams(max_tokens=6, seed=3, temperature=1.0)
first = sampler.sample(prompt, num_samples=2, sampling_params=params).result().sequences
seq = first[0]
whole = tokens_of(data[0]) + list(seq.tokens)
n = len(tokens_of(data[0]))
datum = types.Datum(model_input=types.ModelInput.from_ints(whole[:-1]),
                    loss_fn_inputs={"target_tokens": whole[1:], "weights": [1.0] * (len(whole) - 1)})
trainer = lps(tc, [datum])[0][n - 1 :]
np.testing.assert_allclose(np.asarray(seq.logprobs), trainer, atol=2e-4)

# the snapshot keeps these weights after the run steps on
tc.forward_backward(data, "cross_entropy")
tc.optim_step(adam).result()
again = sampler.sample(prompt, num_samples=2, sampling_params=params).result().sequences
assert [s.tokens for s in again] == [s.tokens for s in first]
np.testing.assert_allclose(np.asarray(again[0].logprobs), np.asarray(first[0].logprobs), atol=1e-5)

# a sampler over a saved checkpoint
path = tc.save_weights_for_sampler("full-w").result().path
info = rc.get_weights_info_by_tinker_path(path).result()
assert info.is_lora is False and info.base_model == QWEN3
from_path = sc.create_sampling_client(model_path=path)
got = from_path.sample(prompt, num_samples=1, sampling_params=params).result().sequences[0]
whole = tokens_of(data[0]) + list(got.tokens)
datum = types.Datum(model_input=types.ModelInput.from_ints(whole[:-1]),
                    loss_fn_inputs={"target_tokens": whole[1:], "weights": [1.0] * (len(whole) - 1)})
np.testing.assert_allclose(np.asarray(got.logprobs), lps(tc, [datum])[0][n - 1 :], atol=2e-4)

# save_state with the optimizer resumes exactly
state = tc.save_state("full-s").result()
resumed = sc.create_training_client_from_state_with_optimizer(state.path).result()
assert rc.get_training_run(resumed.model_id).result().is_lora is False
for a, b in zip(lps(resumed, data), lps(tc, data)):
    np.testing.assert_array_equal(a, b)
for client in (tc, resumed):
    client.forward_backward(data, "cross_entropy")
    client.optim_step(adam).result()
for a, b in zip(lps(resumed, data), lps(tc, data)):
    np.testing.assert_allclose(a, b, atol=1e-6)

# the whole model, exported: transformers loads it with the trainer's logprobs
ext = tc.save_weights_external("full-e").result()
urls = rc.get_external_weights_urls(ext.path).result().urls
assert "config.json" in urls and any(name.endswith(".safetensors") for name in urls), sorted(urls)
with tempfile.TemporaryDirectory() as tmp:
    for name, url in urls.items():
        (Path(tmp) / name).write_bytes(urllib.request.urlopen(url).read())
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32, attn_implementation="eager").eval()
    for d, lp in zip(data, lps(tc, data)):
        with torch.no_grad():
            logits = hf(torch.tensor([tokens_of(d)])).logits[0].float()
        ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(arr(d.loss_fn_inputs["target_tokens"]))[:, None])
        np.testing.assert_allclose(lp, ref[:, 0].numpy(), atol=2e-4)

# the wrong kind of checkpoint, either way, is a clear error and leaves the run as it was
lora_state = lora.save_state("lora-s").result()
before = lps(tc, data)
for client, ckpt, what in ((tc, lora_state.path, "LoRA checkpoint"), (lora, state.path, "full fine-tuning checkpoint")):
    try:
        client.load_state(ckpt).result()
        raise AssertionError("loading the wrong kind of checkpoint must fail")
    except (tinker.BadRequestError, tinker.RequestFailedError, tinker.APIStatusError) as e:
        assert what in str(e), str(e)
for a, b in zip(lps(tc, data), before):
    np.testing.assert_array_equal(a, b)

# a server without --full-finetune refuses rank 0 with a clear 400
other = tinker.ServiceClient(base_url=CONF["extra"]["chunk2"])
try:
    other.create_lora_training_client(base_model=QWEN3, rank=0).result()
    raise AssertionError("rank 0 must be refused without --full-finetune")
except (tinker.BadRequestError, tinker.APIStatusError) as e:
    assert "--full-finetune" in str(e), str(e)
print("ok")
