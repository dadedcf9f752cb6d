"""Stage 8: checkpoints and resume. save_state / save_weights_for_sampler / save_weights_external
(plain and age-encrypted); create_training_client_from_state (same weights, fresh optimizer) and
..._with_optimizer (continues exactly like the original); the REST surface (runs, checkpoints,
weights_info, publish, TTL, signed downloads, copy_weights, delete, sessions); another key sees
none of it until a checkpoint is published."""

import json
import urllib.request

import numpy as np
import pyrage
import tinker
from safetensors.numpy import load as load_safetensors
from tinker import types

from tests.conformance.scenarios.common import CONF, QWEN3, arr, random_datum

rng = np.random.default_rng(8)
data = [random_datum(rng, n) for n in (9, 6, 12)]
adam = types.AdamParams(learning_rate=1e-2)
sc = tinker.ServiceClient(user_metadata={"stage": "8"}, display_name="checkpoints")
session = sc.holder.get_session_id()
tc = sc.create_lora_training_client(base_model=QWEN3, rank=4, seed=8, train_unembed=False,
                                    user_metadata={"renderer_name": "role_colon"}).result()
for _ in range(2):
    tc.forward_backward(data, "cross_entropy")
    tc.optim_step(adam)
state = tc.save_state("s1", ttl_seconds=3600).result()
sampler = tc.save_weights_for_sampler("w1").result()
ext = tc.save_weights_external("e1").result()
identity = pyrage.x25519.Identity.generate()
ext_age = tc.save_weights_external("e2", age_encryption_recipients=[str(identity.to_public())]).result()
run = tc.model_id
assert state.path == f"tinker://{run}/weights/s1" and sampler.path == f"tinker://{run}/sampler_weights/w1"
assert ext.path == f"tinker://{run}/external_weights/e1"
try:
    tc.save_state("s1").result()
    raise AssertionError("a name clash must fail")
except (tinker.BadRequestError, tinker.RequestFailedError) as e:
    assert "already exists" in str(e)


def lps(client):
    return [arr(o["logprobs"]) for o in client.forward(data, "cross_entropy").result().loss_fn_outputs]


saved = lps(tc)
fresh = sc.create_training_client_from_state(state.path).result()
resumed = sc.create_training_client_from_state_with_optimizer(state.path).result()
assert fresh.model_id.startswith(f"{session}:train:") and fresh.model_id != run
for client in (fresh, resumed):
    for a, b in zip(lps(client), saved):
        np.testing.assert_allclose(a, b, atol=1e-6)
    assert client.get_info().lora_rank == 4
# One more identical step on the original, the resumed (with Adam state) and the fresh client.
for client in (tc, resumed, fresh):
    client.forward_backward(data, "cross_entropy")
    client.optim_step(adam).result()
after, after_resumed, after_fresh = lps(tc), lps(resumed), lps(fresh)
for a, b in zip(after_resumed, after):
    np.testing.assert_allclose(a, b, atol=1e-6)
assert max(float(np.abs(a - b).max()) for a, b in zip(after_fresh, after)) > 1e-4, "optimizer state must matter"

# REST
rc = sc.create_rest_client()
ckpts = {c.checkpoint_id: c for c in rc.list_checkpoints(run).result().checkpoints}
assert set(ckpts) == {"weights/s1", "sampler_weights/w1", "external_weights/e1", "external_weights/e2"}, ckpts
assert ckpts["weights/s1"].checkpoint_type == "training" and ckpts["weights/s1"].expires_at is not None
assert ckpts["sampler_weights/w1"].checkpoint_type == "sampler" and ckpts["weights/s1"].size_bytes > 0
assert {c.tinker_path for c in rc.list_user_checkpoints().result().checkpoints} >= {state.path, sampler.path}
tr = rc.get_training_run(run).result()
assert tr.base_model == QWEN3 and tr.is_lora and tr.lora_rank == 4 and tr.user_metadata == {"renderer_name": "role_colon"}
assert tr.last_checkpoint.tinker_path == state.path and tr.last_sampler_checkpoint.tinker_path == sampler.path
assert rc.get_training_run_by_tinker_path(state.path).result().training_run_id == run
page = rc.list_training_runs(limit=1, offset=0).result()
assert len(page.training_runs) == 1 and page.cursor.total_count >= 3
info = rc.get_weights_info_by_tinker_path(state.path).result()
assert (info.base_model, info.lora_rank, info.train_attn, info.train_mlp, info.train_unembed) == (QWEN3, 4, True, True, False)
rc.set_checkpoint_ttl_from_tinker_path(state.path, None).result()
assert {c.checkpoint_id: c for c in rc.list_checkpoints(run).result().checkpoints}["weights/s1"].expires_at is None
rc.set_checkpoint_ttl_from_tinker_path(sampler.path, 7200).result()
assert {c.checkpoint_id: c for c in rc.list_checkpoints(run).result().checkpoints}["sampler_weights/w1"].expires_at is not None

# Signed downloads work with plain urllib (no headers).
urls = rc.get_external_weights_urls(ext.path).result()
files = {name: urllib.request.urlopen(url).read() for name, url in urls.urls.items()}
assert set(files) == {"adapter_model.safetensors", "adapter_config.json"}
cfg = json.loads(files["adapter_config.json"])
assert cfg["r"] == 4 and cfg["lora_alpha"] == 32 and cfg["base_model_name_or_path"] == QWEN3
tensors = load_safetensors(files["adapter_model.safetensors"])
assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in tensors
assert not any("unembed" in k or "lm_head" in k for k in tensors)  # train_unembed=False
age_urls = rc.get_external_weights_urls(ext_age.path).result().urls
assert set(age_urls) == {"adapter_model.safetensors.age", "adapter_config.json.age"}
plain = pyrage.decrypt(urllib.request.urlopen(age_urls["adapter_config.json.age"]).read(), [identity])
assert json.loads(plain)["r"] == 4
bad = urls.urls["adapter_config.json"].rsplit("/", 1)
try:
    urllib.request.urlopen(bad[0] + "/" + bad[1][:-3] + "AAA")
    raise AssertionError("a tampered link must be refused")
except urllib.error.HTTPError as e:
    assert e.code == 403

# Sessions
assert run in rc.get_session(session).result().training_run_ids
assert session in rc.list_sessions(limit=100).result().sessions

# Isolation: another key sees nothing, until a checkpoint is published.
other = tinker.ServiceClient(api_key=CONF["keys"]["bob"])
rc_other = other.create_rest_client()
for call in (lambda: rc_other.get_training_run(run).result(), lambda: rc_other.list_checkpoints(run).result(),
             lambda: rc_other.get_weights_info_by_tinker_path(state.path).result(),
             lambda: rc_other.delete_checkpoint_from_tinker_path(state.path).result(),
             lambda: rc_other.copy_weights(state.path, "default").result()):
    try:
        call()
        raise AssertionError("another key must get 404")
    except tinker.NotFoundError:
        pass
try:
    other.create_training_client_from_state(state.path).result()
    raise AssertionError("another key must not load an unpublished checkpoint")
except tinker.NotFoundError:
    pass
rc.publish_checkpoint_from_tinker_path(state.path).result()
assert {c.checkpoint_id: c for c in rc.list_checkpoints(run).result().checkpoints}["weights/s1"].public
borrowed = other.create_training_client_from_state(state.path).result()
for a, b in zip(lps(borrowed), saved):
    np.testing.assert_allclose(a, b, atol=1e-6)
rc.unpublish_checkpoint_from_tinker_path(state.path).result()
other.close("success").result()

# copy_weights (Ember has no projects: the SDK requires one, the server ignores it): a weights-only
# run sharing the files; same weights, same kind and name
copied = rc.copy_weights(state.path, "default", ttl_seconds=7200).result()
assert copied != state.path and copied.endswith("/weights/s1")
copied_run = rc.get_training_run_by_tinker_path(copied).result()
assert copied_run.training_run_id != run and copied_run.base_model == QWEN3
for a, b in zip(lps(sc.create_training_client_from_state(copied).result()), saved):
    np.testing.assert_allclose(a, b, atol=1e-6)
sampler_copy = rc.copy_weights(sampler.path, "default").result()
assert sampler_copy.endswith("/sampler_weights/w1")
prompt = types.ModelInput.from_ints([3, 9, 27, 81])
before = sc.create_sampling_client(model_path=sampler_copy).compute_logprobs(prompt).result()

# Delete: gone from listings, 404 afterwards; loading it fails. A copy keeps the shared files.
rc.delete_checkpoint_from_tinker_path(sampler.path).result()
after = sc.create_sampling_client(model_path=sampler_copy).compute_logprobs(prompt).result()
np.testing.assert_allclose(after[1:], before[1:], atol=1e-6)
assert "sampler_weights/w1" not in {c.checkpoint_id for c in rc.list_checkpoints(run).result().checkpoints}
try:
    rc.get_weights_info_by_tinker_path(sampler.path).result()
    raise AssertionError("deleted checkpoint must be 404")
except tinker.NotFoundError:
    pass
print("storage", CONF["storage"])
sc.close("success").result()
print("stage 8 ok")
