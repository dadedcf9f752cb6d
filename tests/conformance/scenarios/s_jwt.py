"""Flag run ``pjwt_auth_enabled`` (an API-only server on the same database hands it out): the SDK
exchanges Alice's key at POST /auth/token and sends the JWT on every request; training, sampling
and the REST listing work as with the key, the objects belong to Alice's key, and
RestClient.whoami() reads the identity from the token."""

import numpy as np
import tinker
from tinker import types

from ember.store import Store
from tests.conformance.scenarios.common import CONF, QWEN3, random_datum

sc = tinker.ServiceClient(base_url=CONF["extra"]["jwt"])
tc = sc.create_lora_training_client(base_model=QWEN3, rank=4, seed=5).result()
rng = np.random.default_rng(5)
data = [random_datum(rng, 12) for _ in range(2)]
losses = []
for _ in range(3):
    losses.append(tc.forward_backward(data, "cross_entropy").result().metrics["loss:sum"])
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
assert losses[-1] < losses[0], losses
sampler = tc.save_weights_and_get_sampling_client()
out = sampler.sample(types.ModelInput.from_ints([1, 2, 3]), 1, types.SamplingParams(max_tokens=4, seed=0)).result()
assert len(out.sequences[0].tokens) == 4

store = Store.open(CONF["database_url"], pool_size=1, run_migrations=False)
alice = store.owner_of_key(CONF["keys"]["alice"])
assert store.get_model(tc.model_id, alice) is not None  # created under Alice's key, through her JWT
store.close()
rest = sc.create_rest_client()
me = rest.whoami().result()  # raises unless the SDK holds a JWT from this server
assert me.user_urn == alice and me.org_urn == "tml:organization:ember" and me.email is None, me
assert tc.model_id in [r.training_run_id for r in rest.list_training_runs().result().training_runs]
sc.close("success").result()
print("jwt flag run ok", losses)
