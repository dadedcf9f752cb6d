"""Stage 6: client-side custom loss (forward_backward_custom): the server runs a forward pass, then a
cross_entropy backward with real-valued weights -dC/dlp. Judge: a second adapter from the same seed
trained with those weights computed by hand (float64) ends with the same weights."""

import numpy as np
import tinker
import torch
from tinker import types

from tests.conformance.scenarios.common import QWEN3, arr, random_datum

rng = np.random.default_rng(6)
data = [random_datum(rng, n) for n in (7, 10, 5)]
sc = tinker.ServiceClient()
tc_a = sc.create_lora_training_client(base_model=QWEN3, rank=8, seed=6).result()
tc_b = sc.create_lora_training_client(base_model=QWEN3, rank=8, seed=6).result()


def custom(data, logprobs_list):
    loss = sum((0.1 * lp**2 - lp).sum() for lp in logprobs_list)
    return loss, {"custom_mean:mean": float(torch.cat(logprobs_list).mean())}


lp0 = [arr(o["logprobs"]).astype(np.float64) for o in tc_a.forward(data, "cross_entropy").result().loss_fn_outputs]
res = tc_a.forward_backward_custom(data, custom).result()
expected = sum((0.1 * lp**2 - lp).sum() for lp in lp0)
assert abs(res.metrics["loss:sum"] - expected) < 1e-4 * abs(expected), (res.metrics, expected)
assert "surrogate_loss:sum" in res.metrics and "custom_mean:mean" in res.metrics
tc_a.optim_step(types.AdamParams(learning_rate=1e-2)).result()

manual = [types.Datum(model_input=d.model_input,
                      loss_fn_inputs={"target_tokens": d.loss_fn_inputs["target_tokens"],
                                      "weights": (-(0.2 * lp - 1.0)).astype(np.float32)})
          for d, lp in zip(data, lp0)]
tc_b.forward_backward(manual, "cross_entropy").result()
tc_b.optim_step(types.AdamParams(learning_rate=1e-2)).result()
after_a = tc_a.forward(data, "cross_entropy").result().loss_fn_outputs
after_b = tc_b.forward(data, "cross_entropy").result().loss_fn_outputs
moved = 0.0
for a, b, l0 in zip(after_a, after_b, lp0):
    np.testing.assert_allclose(arr(a["logprobs"]), arr(b["logprobs"]), atol=1e-5)
    moved = max(moved, float(np.abs(arr(a["logprobs"]) - l0).max()))
assert moved > 1e-3, "the custom loss must have changed the weights"
sc.close("success").result()
print("stage 6 ok")
