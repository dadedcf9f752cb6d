"""The engine process loop in-process: requests from the store run in seq_id order, forward/backward
requests of different models share ONE packed Worker call and each gets what it would alone,
checkpoints round-trip through fsspec (memory://) storage, external exports are age-encrypted."""

import uuid

import numpy as np
import pytest
import torch

from ember.engine.builtin import build_model
from ember.engine.service import EngineService
from ember.engine.worker import Worker
from ember.storage import Storage
from ember.store import Store
from ember.store.payload import decode, encode
from tests.store.backend import fresh_database


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_model(tmp_path_factory.mktemp("tiny") / "qwen3", "qwen3", seed=1)


@pytest.fixture
def engine(model_dir, tmp_path):
    with fresh_database(tmp_path) as url:
        store = Store.open(url)
        worker = Worker.from_pretrained(model_dir, "cpu", torch.float32, max_adapters=4, max_rank=8)
        calls = []
        original = worker.forward_backward

        def recording(requests):
            calls.append([r.slot for r in requests])
            return original(requests)

        worker.forward_backward = recording
        svc = EngineService(store, Storage(f"memory://ember-{uuid.uuid4().hex}"), "tiny", worker)
        svc.calls = calls
        yield svc
        store.close()


def _drain(svc, max_steps=50):
    for _ in range(max_steps):
        if not svc.step():
            return
    raise AssertionError("engine did not become idle")


def _create(svc, session, n, seed):
    lora = {"rank": 4, "alpha": 32.0, "targets": ["attn", "mlp", "unembed"], "seed": seed}
    svc.store.submit_model(owner="o", session_id=session, model_seq_id=n, base_model="tiny", lora=lora,
                           optimizer_config={"type": "adamw"}, user_metadata={}, op="create_model",
                           payload=encode({"lora": lora}))
    return f"{session}:train:{n}"


def _fwdbwd(tokens, forward_only=False):
    tokens = np.asarray(tokens, np.int64)
    datum = {"tokens": tokens[:-1], "loss_inputs": {"target_tokens": tokens[1:],
                                                     "weights": np.linspace(0.5, 1.5, tokens.size - 1).astype(np.float32)}}
    return encode({"loss_fn": "cross_entropy", "loss_config": {}, "forward_only": forward_only, "datums": [datum]})


def _submit(svc, mid, seq, op, payload, n_tokens=0):
    return svc.store.submit(owner="o", base_model="tiny", op=op, payload=payload, model_id=mid, seq_id=seq,
                            n_tokens=n_tokens)


def _result(svc, rid):
    row = svc.store.get_future(rid, "o")
    assert row.state == "done", row.error
    return decode(row.result)


def test_two_models_train_in_one_pass_and_match_running_alone(engine, model_dir):
    session = engine.store.create_session("o", None, [], {}, None)
    a, b = _create(engine, session, 0, seed=1), _create(engine, session, 1, seed=2)
    _drain(engine)
    rng = np.random.default_rng(0)
    seq_a, seq_b = rng.integers(0, 500, 12), rng.integers(0, 500, 9)
    # Out of order: b's optim_step (seq 2) arrives before its forward_backward (seq 1).
    ob = _submit(engine, b, 2, "optim_step", encode({"adam": {"learning_rate": 0.01}}))
    fa = _submit(engine, a, 1, "forward_backward", _fwdbwd(seq_a), 11)
    fb = _submit(engine, b, 1, "forward_backward", _fwdbwd(seq_b), 8)
    _drain(engine)
    assert engine.calls == [[engine.slots[a], engine.slots[b]]]  # ONE packed pass with both adapters
    assert _result(engine, ob)["metrics"]["grad_norm"] > 0
    assert engine.store.get_model(b, "o").next_seq == 3

    # Reference: each request alone on a fresh worker with the same adapter seeds.
    from ember.core.adapters import LoraConfig
    from ember.types import Datum, ForwardBackwardInput

    ref = Worker.from_pretrained(model_dir, "cpu", torch.float32, max_adapters=4, max_rank=8)
    for seq, seed, rid in ((seq_a, 1, fa), (seq_b, 2, fb)):
        slot = ref.create_adapter(LoraConfig(rank=4, alpha=32.0, seed=seed))
        p = decode(_fwdbwd(seq))["datums"][0]
        (alone,) = ref.forward_backward([ForwardBackwardInput(slot, [Datum(p["tokens"], p["loss_inputs"])])])
        got = _result(engine, rid)
        np.testing.assert_allclose(got["logprobs"][0], alone.logprobs[0], atol=2e-5)
        w = p["loss_inputs"]["weights"].astype(np.float64)
        assert got["metrics"]["loss:sum"] == pytest.approx(-(w * got["logprobs"][0].astype(np.float64)).sum(), rel=1e-5)


def test_rejected_requests_hold_their_seq_id_and_fail_with_their_message(engine):
    session = engine.store.create_session("o", None, [], {}, None)
    a = _create(engine, session, 0, seed=3)
    bad = _submit(engine, a, 1, "rejected", encode({"error": "loss_fn 'nope' is not supported"}))
    ok = _submit(engine, a, 2, "forward_backward", _fwdbwd([1, 2, 3, 4]), 3)
    _drain(engine)
    row = engine.store.get_future(bad, "o")
    assert (row.state, row.category, row.error) == ("failed", "user", "loss_fn 'nope' is not supported")
    assert _result(engine, ok)["logprobs"][0].shape == (3,)


def test_checkpoints_roundtrip_through_fsspec_storage(engine):
    session = engine.store.create_session("o", None, [], {}, None)
    a = _create(engine, session, 0, seed=4)
    _submit(engine, a, 1, "forward_backward", _fwdbwd(np.arange(20) % 300), 19)
    _submit(engine, a, 2, "optim_step", encode({"adam": {"learning_rate": 0.05}}))
    uri = engine.storage.uri_for("o", a, "training", "s1")
    save = _submit(engine, a, 3, "save_weights", encode({"uri": uri, "with_optimizer": True, "metadata": {}}))
    _drain(engine)
    assert _result(engine, save)["size_bytes"] > 0
    assert {n for n, _ in engine.storage.list_files(uri)} == {"metadata.json", "adapter.safetensors",
                                                            "optimizer.safetensors"}
    engine.store.submit_model(owner="o", session_id=session, model_seq_id=1, base_model="tiny", lora={"rank": 4},
                              optimizer_config={}, user_metadata={}, op="load_model",
                              payload=encode({"uri": uri, "with_optimizer": True}))
    _drain(engine)
    b = f"{session}:train:1"
    src, dst = engine.worker.adapter(engine.slots[a]), engine.worker.adapter(engine.slots[b])
    for name, t in src.tensors().items():
        torch.testing.assert_close(dst.tensors()[name], t, rtol=0, atol=0)


def test_external_export_is_age_encrypted_for_the_recipients(engine):
    pyrage = pytest.importorskip("pyrage")
    from safetensors.numpy import load

    identity = pyrage.x25519.Identity.generate()
    session = engine.store.create_session("o", None, [], {}, None)
    a = _create(engine, session, 0, seed=5)
    uri = engine.storage.uri_for("o", a, "external", "e1")
    rid = _submit(engine, a, 1, "save_external",
                  encode({"uri": uri, "base_model": "tiny", "recipients": [str(identity.to_public())]}))
    _drain(engine)
    assert _result(engine, rid)["size_bytes"] > 0
    files = {n for n, _ in engine.storage.list_files(uri)}
    assert files == {"adapter_model.safetensors.age", "adapter_config.json.age"}
    with engine.storage.open_file(uri, "adapter_model.safetensors.age") as f:
        tensors = load(pyrage.decrypt(f.read(), [identity]))
    assert any(k.endswith("lora_A.weight") for k in tensors)


def test_an_op_queued_behind_a_pass_runs_in_the_same_tick_and_result_datagrams_carry_it(engine):
    """The optim_step the SDK sends right after a forward_backward is claimed by the pass's finish
    and runs at once (one ``step()``), and the result datagrams the API receives carry what the
    store holds."""
    import socket

    from ember.doorbell import parse_results

    listener = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    listener.bind(("127.0.0.1", 0))
    listener.settimeout(2.0)
    engine.store.listen_results("api-test", socket.gethostname(), listener.getsockname()[1])
    session = engine.store.create_session("o", None, [], {}, None)
    a = _create(engine, session, 0, seed=6)
    _drain(engine)
    fb = _submit(engine, a, 1, "forward_backward", _fwdbwd(np.arange(12) % 300), 11)
    opt = _submit(engine, a, 2, "optim_step", encode({"adam": {"learning_rate": 0.01}}))
    fb2 = _submit(engine, a, 3, "forward_backward", _fwdbwd(np.arange(12) % 300), 11)
    engine._listeners = (-1e9, [])  # read the listener registered above
    assert engine.step()
    # the pass and the optim_step ran; the next forward_backward waits for the next tick
    assert engine.store.get_future(opt, "o").state == "done" and engine.store.get_future(fb2, "o").state == "pending"
    assert engine.store.get_model(a, "o").next_seq == 3
    key = engine._result_key
    got = {}
    while not {fb, opt} <= set(got):
        got.update(parse_results(key, listener.recv(65536)) or {})
    for rid in (fb, opt):
        row = engine.store.get_future(rid, "o")
        assert got[rid] == ("done", row.result, None, None)
    # an op is only claimed when it is next in order and its model is active
    engine.store.finish([], model_status={a: ("unloaded", "gone")})
    _drain(engine)
    assert engine.store.get_future(fb2, "o").state == "failed"
    listener.close()


def test_stability_records_are_dropped_when_their_session_ends(engine):
    """Ending a session queues an unload of each of its samplers; the engine then forgets the
    samplers' stability records, and a datum naming one gets an error that says so."""
    from ember.engine.stability import RecordMissing
    from tests.unit.test_stability_store import record

    session = engine.store.create_session("o", None, [], {}, None)
    sampler = engine.store.create_sampling_session(owner="o", session_id=session, seq=0, base_model="tiny",
                                                   model_path=None, weights_uri=None)
    other = engine.store.create_session("o", None, [], {}, None)
    engine.stability.put("r1:0", record(session=session, sampler=sampler))
    engine.stability.put("r2:0", record(session=other, sampler=f"{other}:sample:0"))
    engine.store.end_session(session, "client_finished", "success")
    _drain(engine)
    with pytest.raises(RecordMissing, match="its session ended"):
        engine.stability.get("r1:0", session)
    assert engine.stability.get("r2:0", other) is not None
