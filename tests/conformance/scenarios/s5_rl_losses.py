"""Stage 5: RL losses against their formulas (spec §3.4, float64), an unknown loss_fn is a 400 with
a body, and the client keeps working afterwards."""

import numpy as np
import tinker
from tinker import types

from tests.conformance.scenarios.common import QWEN3, arr, check_metric_keys

rng = np.random.default_rng(5)
sc = tinker.ServiceClient()
tc = sc.create_lora_training_client(base_model=QWEN3, rank=8, seed=5).result()
seqs = [rng.integers(0, 512, n + 1) for n in (8, 5)]
plain = [types.Datum(model_input=types.ModelInput.from_ints(s[:-1].tolist()),
                     loss_fn_inputs={"target_tokens": s[1:].tolist()}) for s in seqs]
# One step first, so the adapter is not the base model.
tc.forward_backward(plain, "cross_entropy").result()
tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
lp_now = [arr(o["logprobs"]).astype(np.float64) for o in tc.forward(plain, "cross_entropy").result().loss_fn_outputs]

q = [lp + rng.normal(0, 0.3, lp.shape) for lp in lp_now]  # the "sampler's" logprobs
adv = [rng.normal(0, 1, lp.shape) for lp in lp_now]
data = [types.Datum(model_input=d.model_input,
                    loss_fn_inputs={"target_tokens": d.loss_fn_inputs["target_tokens"],
                                    "logprobs": qi.astype(np.float32), "advantages": ai.astype(np.float32)})
        for d, qi, ai in zip(plain, q, adv)]
Q, A = np.concatenate(q).astype(np.float32).astype(np.float64), np.concatenate(adv).astype(np.float32).astype(np.float64)


def formula(name, lp, cfg):
    r = np.exp(lp - Q)
    lo, hi = cfg.get("clip_low_threshold"), cfg.get("clip_high_threshold")
    if name == "importance_sampling":
        return -(r * A).sum()
    if name == "ppo":
        return -np.minimum(r * A, np.clip(r, lo, hi) * A).sum()
    if name == "cispo":
        return -(np.clip(r, lo, hi) * lp * A).sum()
    if name == "dro":
        return -(lp * A - 0.5 * cfg["beta"] * (lp - Q) ** 2).sum()
    raise ValueError(name)


cases = [("importance_sampling", {}, {}), ("ppo", {}, {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
         ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}, None),
         ("cispo", {"clip_low_threshold": 0.5, "clip_high_threshold": 1.5}, None), ("dro", {"beta": 0.05}, None)]
for name, cfg, effective in cases:
    out = tc.forward_backward(data, name, cfg or None).result()
    check_metric_keys(out.metrics)
    lp = np.concatenate([arr(o["logprobs"]).astype(np.float64) for o in out.loss_fn_outputs])
    np.testing.assert_allclose(lp, np.concatenate(lp_now), atol=1e-5)
    want = formula(name, lp, effective if effective is not None else cfg)
    assert abs(out.metrics["loss:sum"] - want) < 1e-4 * max(1, abs(want)), (name, out.metrics, want)
    print(name, cfg, "ok")

try:
    tc.forward_backward(plain, "no_such_loss").result()
    raise AssertionError("unknown loss_fn must fail")
except tinker.BadRequestError as e:
    assert "no_such_loss" in str(e) and "supported" in str(e)
try:  # missing inputs for ppo
    tc.forward_backward(plain, "ppo").result()
    raise AssertionError("ppo without advantages must fail")
except tinker.BadRequestError as e:
    assert "advantages" in str(e)
assert tc.optim_step(types.AdamParams(learning_rate=1e-3)).result().metrics["grad_norm"] > 0  # not poisoned
bad = tc.optim_step(types.AdamParams(learning_rate=-1.0))
try:
    bad.result()
    raise AssertionError("a negative learning rate must fail")
except tinker.RequestFailedError as e:
    assert "learning_rate" in str(e)
tc.forward(plain, "cross_entropy").result()
sc.close("success").result()
print("stage 5 ok")
