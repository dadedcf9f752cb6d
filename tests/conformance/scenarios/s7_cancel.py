"""Stage 7, cancel: with `sample_cancel_enabled` in client/dynamic_config, a sample whose awaiting
caller gives up (a timeout, then cancel()) makes the SDK send POST /api/v1/cancel_future for it. The request
then ends as cancelled (if no engine had taken it) or runs to its end (if one had); either way the
client, and the next sample, keep working. The test checks the server's log for the cancel."""

import time

import tinker
from tinker import types

from ember.store import Store
from ember.store.models import Future
from tests.conformance.scenarios.common import CONF, QWEN3

sc = tinker.ServiceClient()
sampler = sc.create_sampling_client(base_model=QWEN3).result()
assert sampler.holder._client_dynamic_config.sample_cancel_enabled
prompt = types.ModelInput.from_ints([1, 2, 3, 4])
params = types.SamplingParams(max_tokens=512, temperature=1.0, seed=3, stop=[])


store = Store.open(CONF["database_url"], pool_size=1, run_migrations=False)


def sampler_rows():
    with store.read() as s:
        return s.query(Future).filter(Future.sampler_id == sampler._sampling_session_id).all()


fut = sampler.sample(prompt, num_samples=8, sampling_params=params)
deadline = time.monotonic() + 10
while not sampler_rows() and time.monotonic() < deadline:  # submitted: the SDK now polls for it
    time.sleep(0.005)
outcome = "cancelled" if fut.cancel() else "finished first"
time.sleep(2.0)  # the SDK sends cancels from a background queue
rows = sampler_rows()
states = sorted((r.state, r.error) for r in rows)
print("abandoned sample:", outcome, states)
assert outcome == "cancelled" and len(rows) == 1, (outcome, states)
out = sampler.sample(prompt, num_samples=1, sampling_params=types.SamplingParams(max_tokens=4, seed=1)).result()
assert len(out.sequences[0].tokens) == 4
sc.close("success").result()
print("stage 7 cancel ok", rows[0].id)
