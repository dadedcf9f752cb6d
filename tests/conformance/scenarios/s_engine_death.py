"""An engine process dies: its queued requests fail with a clear error, its models are lost (410),
the API keeps answering, the engine restarts and serves new models; the other base model's engine
is untouched."""

import json
import os
import signal
import time
import urllib.request

import numpy as np
import tinker
from tinker import types

from ember.store import Store
from tests.conformance.scenarios.common import CONF, MOE, QWEN3, random_datum

store = Store.open(CONF["database_url"], pool_size=1, run_migrations=False)
data = [random_datum(np.random.default_rng(0), 6)]
sc = tinker.ServiceClient()
tc = sc.create_lora_training_client(base_model=QWEN3, rank=4, seed=1).result()
moe = sc.create_lora_training_client(base_model=MOE, rank=4, seed=1).result()
tc.forward_backward(data, "cross_entropy").result()
engine = next(e for e in store.engines() if e.base_model == QWEN3)

os.kill(engine.pid, signal.SIGSTOP)  # frozen: the next request stays queued
pending = tc.forward_backward(data, "cross_entropy")
time.sleep(1.0)
os.kill(engine.pid, signal.SIGKILL)
try:
    pending.result()
    raise AssertionError("a request queued on a dead engine must fail")
except tinker.RequestFailedError as e:
    assert "died" in str(e) and "restarting" in str(e), e

# The API keeps answering while the engine restarts; the MoE engine keeps training.
caps = sc.create_rest_client().get_server_capabilities().result()
assert {m.model_name for m in caps.supported_models} == {QWEN3, MOE}
moe.forward_backward(data, "cross_entropy").result()
try:
    tc.forward_backward(data, "cross_entropy").result()
    raise AssertionError("a lost model must refuse requests")
except tinker.APIStatusError as e:
    assert e.status_code == 410 and "lost" in str(e)

deadline = time.time() + 180
while time.time() < deadline:
    with urllib.request.urlopen(CONF["base_url"] + "/api/v1/healthz") as r:
        if json.load(r)["engines"][QWEN3] == "ready":
            break
    time.sleep(0.5)
restarted = next(e for e in store.engines() if e.base_model == QWEN3)
assert restarted.generation == engine.generation + 1 and restarted.pid != engine.pid
fresh = sc.create_lora_training_client(base_model=QWEN3, rank=4, seed=1).result()
out = fresh.forward_backward(data, "cross_entropy").result()
assert out.metrics["loss:sum"] > 0
fresh.optim_step(types.AdamParams()).result()
sc.close("success").result()
store.close()
print("engine death ok")
