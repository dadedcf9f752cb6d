"""The official SDK against an engine of two processes (``ember serve --nproc 2 --ep 2``: experts
split between them; ``--tp 2``: attention heads and MLP width split): step-0 logprobs equal transformers', two adapters train at the
same time (each as it would alone, as the one-process engine does), checkpoints resume exactly,
seeded samples repeat, and the sampler's logprobs are the trainer's."""

import numpy as np
import tinker
from tinker import types

from tests.conformance.scenarios.common import MOE, arr, random_datum, reference_logprobs, tokens_of

sc = tinker.ServiceClient(display_name="sharded")
rng = np.random.default_rng(3)
adam = types.AdamParams(learning_rate=2e-2)
clients = [sc.create_lora_training_client(base_model=MOE, rank=r, seed=s) for r, s in ((8, 0), (4, 1))]
data = [[random_datum(rng, n) for n in (9, 14, 5)], [random_datum(rng, n) for n in (11, 6)]]


def lps(tc, batch):
    return [arr(o["logprobs"]) for o in tc.forward(batch, "cross_entropy").result().loss_fn_outputs]


for d, lp in zip(data[0], lps(clients[0], data[0])):
    ref = reference_logprobs(MOE, tokens_of(d), arr(d.loss_fn_inputs["target_tokens"]))
    np.testing.assert_allclose(lp, ref, atol=2e-4, rtol=0)

# both adapters train together: requests interleaved, so they share packed passes
losses = [[], []]
for _ in range(4):
    futs = [(tc.forward_backward(b, "cross_entropy"), tc.optim_step(adam)) for tc, b in zip(clients, data)]
    for i, (fb, opt) in enumerate(futs):
        losses[i].append(fb.result().metrics["loss:sum"])
        opt.result()
for run in losses:
    assert run[-1] < run[0] - 1.0, losses

# a checkpoint (gathered from both ranks) resumes exactly, optimizer state included
state = clients[0].save_state("sharded").result()
resumed = sc.create_training_client_from_state_with_optimizer(state.path).result()
for a, b in zip(lps(resumed, data[0]), lps(clients[0], data[0])):
    np.testing.assert_allclose(a, b, atol=1e-6)
for tc in (clients[0], resumed):
    tc.forward_backward(data[0], "cross_entropy")
    tc.optim_step(adam).result()
for a, b in zip(lps(resumed, data[0]), lps(clients[0], data[0])):
    np.testing.assert_allclose(a, b, atol=1e-6)

# sampling: seeded draws repeat; each token's logprob is what the trainer computes for it
sampler = clients[1].save_weights_and_get_sampling_client()
prompt = types.ModelInput.from_ints(tokens_of(data[1][0]))
params = types.SamplingParams(max_tokens=6, seed=11, temperature=1.0)
first = sampler.sample(prompt, num_samples=2, sampling_params=params).result().sequences
again = sampler.sample(prompt, num_samples=2, sampling_params=params).result().sequences
assert [s.tokens for s in first] == [s.tokens for s in again]
seq = first[0]
full = tokens_of(data[1][0]) + list(seq.tokens)
n = len(tokens_of(data[1][0]))
datum = types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                    loss_fn_inputs={"target_tokens": full[1:], "weights": [1.0] * (len(full) - 1)})
trainer = lps(clients[1], [datum])[0][n - 1 :]
np.testing.assert_allclose(np.asarray(seq.logprobs), trainer, atol=1e-4)
print("sharded ok", losses)
