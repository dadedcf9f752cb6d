"""Stage 6: custom losses. (1) A client-side callable (forward_backward_custom): the server runs a
forward pass, then a cross_entropy backward with real-valued weights -dC/dlp. (2) A loss made with
create_custom_loss, on the default server (custom_loss_server_side off: it runs client-side like
(1)) and on a server with the flag on (uploaded, run by the engine in one forward_backward with
loss_fn="custom"). Judge: a second adapter from the same seed trained with weights -dC/dlp computed by
hand (float64) ends with the same weights, and loss:sum equals the float64 loss."""

import numpy as np
import tinker
import torch
import torch.nn.functional as F
from tinker import types

from tests.conformance.scenarios.common import CONF, QWEN3, arr, random_datum

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
print("client-side callable ok")

BETA = 0.5


def preference(logprobs, ref, weights):
    margin = ((logprobs - ref) * weights).sum()
    return -F.logsigmoid(BETA * margin) + 0.1 * (logprobs**2).sum(), {"custom/margin:mean": margin.detach()}


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


refs = [(-rng.random(len(arr(d.loss_fn_inputs["target_tokens"]))) * 4).astype(np.float32) for d in data]
pref_data = [types.Datum(model_input=d.model_input,
                         loss_fn_inputs={"target_tokens": d.loss_fn_inputs["target_tokens"], "weights": d.loss_fn_inputs["weights"],
                                         "ref": ref}) for d, ref in zip(data, refs)]
for flag, url in (("off", CONF["base_url"]), ("on", CONF["extra"]["custom_loss"])):
    sc = tinker.ServiceClient(base_url=url)
    tc_a = sc.create_lora_training_client(base_model=QWEN3, rank=8, seed=7).result()
    tc_b = sc.create_lora_training_client(base_model=QWEN3, rank=8, seed=7).result()
    assert sc.holder.get_client_config().custom_loss_server_side == (flag == "on")
    handle = sc.create_custom_loss(preference, {"logprobs": 1, "ref": 1, "weights": 1}).result()
    assert (handle.loss_id is not None) == (flag == "on"), handle
    lp0 = [arr(o["logprobs"]).astype(np.float64) for o in tc_a.forward(data, "cross_entropy").result().loss_fn_outputs]
    res = tc_a.forward_backward_custom(pref_data, handle).result()
    expected, manual, margins = 0.0, [], []
    for d, lp, ref in zip(data, lp0, refs):
        w = arr(d.loss_fn_inputs["weights"]).astype(np.float64)
        m = float((w * (lp - ref)).sum())
        margins.append(m)
        expected += -np.log(sigmoid(BETA * m)) + 0.1 * float((lp**2).sum())
        grad = -BETA * w * sigmoid(-BETA * m) + 0.2 * lp  # dC/dlp
        manual.append(types.Datum(model_input=d.model_input,
                                  loss_fn_inputs={"target_tokens": d.loss_fn_inputs["target_tokens"],
                                                  "weights": (-grad).astype(np.float32)}))
    assert abs(res.metrics["loss:sum"] - expected) < 1e-4 * abs(expected), (flag, res.metrics, expected)
    assert abs(res.metrics["custom/margin:mean"] - np.mean(margins)) < 1e-3, (flag, res.metrics, margins)
    tc_a.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    tc_b.forward_backward(manual, "cross_entropy").result()
    tc_b.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    after_a = tc_a.forward(data, "cross_entropy").result().loss_fn_outputs
    after_b = tc_b.forward(data, "cross_entropy").result().loss_fn_outputs
    for a, b in zip(after_a, after_b):
        np.testing.assert_allclose(arr(a["logprobs"]), arr(b["logprobs"]), atol=1e-5)
    sc.close("success").result()
    print(f"create_custom_loss with custom_loss_server_side {flag} ok")
print("stage 6 ok")
