"""``ember serve --ray``: the placement rule (pure, on a simulated 4 nodes x 8 GPUs), then a local
Ray cluster of two logical nodes (``ray.cluster_utils.Cluster``, one CPU each, told apart by a
custom resource) serving the tiny MoE model with ``--device cpu --nproc 2 --ep 2``: the SDK scenario
(tests/conformance/scenarios/s_sharded.py: parity, training and sampling, checkpoints) and the
actors' own memory in ``ember status``, then one actor killed with ``ray.kill``: the engine stops,
the supervisor starts it anew, and the scenario passes again. Last, two more nodes and a second
server on the same cluster: two base models (one actor each) with checkpoints in an fsspec URL; a
checkpoint written by one engine is loaded after its node is lost and the engine is placed on a
new node, and downloaded through the API."""

from __future__ import annotations

import inspect
import os
import re
import time
from pathlib import Path

import numpy as np
import pytest

from ember.engine.ray_engine import FOLDER_ARGS, assign_ranks
from tests.parallel.serving import MOE, models_server, moe_server


def _shuffled_4x8() -> list[str]:
    """Bundle -> node of a 32-bundle placement group over 4 nodes of 8 GPUs, as Ray may order it."""
    import random

    nodes = [f"node{n}" for n in range(4) for _ in range(8)]
    random.Random(0).shuffle(nodes)
    return nodes


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_tensor_parallel_groups_never_cross_nodes(tp):
    nodes = _shuffled_4x8()
    order = assign_ranks(nodes, tp)
    assert sorted(order) == list(range(32))  # every bundle gets one rank
    by_rank = [nodes[b] for b in order]
    for start in range(0, 32, tp):
        assert len(set(by_rank[start:start + tp])) == 1, (tp, start, by_rank)
    # consecutive ranks share a node: each node's ranks are one run of 8
    assert [by_rank[r] for r in range(0, 32, 8)] == sorted(set(nodes), key=nodes.index)
    assert all(len(set(by_rank[r:r + 8])) == 1 for r in range(0, 32, 8))
    # a node's bundles keep their index order (stable ranks across the same placement)
    for node in set(nodes):
        mine = [b for b in order if nodes[b] == node]
        assert mine == sorted(mine)


def test_a_node_whose_share_is_not_a_multiple_of_tp_is_refused():
    nodes = ["a"] * 6 + ["b"] * 2 + ["c"] * 8  # PACK may split a placement group unevenly
    assert len(assign_ranks(nodes, 2)) == 16
    with pytest.raises(ValueError, match=r"6 bundles on node a, 2 bundles on node b, not a multiple of --tp 4"):
        assign_ranks(nodes, 4)
    with pytest.raises(ValueError, match="tp must be at least 1"):
        assign_ranks(nodes, 0)


def test_every_call_that_takes_a_folder_is_relayed():
    """The calls whose folder is relayed to actors on other nodes are exactly the rank calls
    with a ``path`` parameter (a new one cannot be forgotten)."""
    from ember.engine.ranks import COLLECTIVE, ON_RANK0
    from ember.engine.sharded import ShardedWorker

    takes_path = {n for n in COLLECTIVE | ON_RANK0 if "path" in inspect.signature(getattr(ShardedWorker, n)).parameters}
    assert takes_path == set(FOLDER_ARGS), takes_path ^ set(FOLDER_ARGS)


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_the_supervisor_passes_ray_to_the_engine():
    from types import SimpleNamespace

    from ember.server.supervisor import EngineOptions, EngineSupervisor

    models = {"m": SimpleNamespace(path="/models/m")}
    cmd = EngineSupervisor(None, models, EngineOptions("sqlite://", "/s", ray="auto")).command("m")
    assert cmd[cmd.index("--ray") + 1] == "auto" and cmd[cmd.index("--nproc") + 1] == "1"  # even one rank is an actor
    assert "--ray" not in EngineSupervisor(None, models, EngineOptions("sqlite://", "/s", nproc=2)).command("m")


def test_serve_refuses_storage_that_only_one_process_sees(tmp_path, capsys):
    from ember.cli import main

    assert main(["serve", "--home", str(tmp_path), "--storage", "memory://ckpts", "--ray", "auto"]) == 2
    assert "memory:// lives in one process" in capsys.readouterr().err


@pytest.fixture(scope="module")
def ray_cluster():
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"node_a": 1}, "include_dashboard": False})
    cluster.add_node(num_cpus=1, resources={"node_b": 1})
    cluster.wait_for_nodes()
    try:
        yield cluster
    finally:
        cluster.shutdown()


def test_fan_out_runs_every_call_on_every_actor_and_reports_rank_0(ray_cluster, tmp_path):
    """In this process (the driver): calls reach both actors; an error every rank raises alike,
    and one every rank reached the resync barrier with, come back as rank 0's error and leave the
    actors in step; an attribute of rank 0's worker is read through its actor. Each actor reports
    its own memory. Checkpoint folders of this machine that an actor's node does not see travel
    through Ray: a checkpoint saved and loaded that way gives the trained adapter's logprobs on
    both ranks (EP: each holds half the experts' adapters)."""
    import ray

    from ember.core.adapters import LoraConfig
    from ember.core.optim import AdamParams
    from ember.engine.builtin import build_model
    from ember.engine.ray_engine import RayFanOut
    from ember.types import Datum, ForwardBackwardInput, InvalidRequest

    path = str(build_model(tmp_path / MOE, "qwen3_moe", seed=2))
    shared = tmp_path / "shared"
    fo = RayFanOut.start(ray_cluster.address, dict(
        model_path=path, device="cpu", dtype="float32", nproc=2, ep=2, tp=1, expert_fsdp=False, cpu_threads=1,
        log_level="WARNING", log_format="text", kwargs=dict(max_adapters=4, max_rank=16), name="fanout-test",
        shared=[str(shared)]))
    try:
        assert [r["rank"] for r in fo.ranks["ranks"]] == [0, 1]
        slot = fo.create_adapter(LoraConfig(rank=8))
        assert fo.create_adapter(LoraConfig(rank=8)) == slot + 1  # both actors' banks moved in step
        with pytest.raises(ValueError, match="outside 1..16"):
            fo.bank.validate(LoraConfig(rank=64))
        assert fo.config.model_type == "qwen3_moe"  # not a collective call: rank 0's worker answers
        with pytest.raises(InvalidRequest):
            fo.optim_step(slot, AdamParams(learning_rate=-1.0))
        with pytest.raises(KeyError, match="slot 999 is empty") as e:  # not ALIKE: both ranks meet at the resync barrier
            fo.free_adapter(999)
        assert not isinstance(e.value, ray.exceptions.RayError), type(e.value)
        fo.free_adapter(slot)
        assert fo.create_adapter(LoraConfig(rank=8)) == slot  # still in step after the errors

        # memory: each actor's own resident set, not this process's (made larger than theirs)
        ballast = np.ones(32 << 20)  # 256 MiB, resident
        total, ranks = fo.memory_report(every_s=0)
        info = (ranks or fo.ranks)["ranks"]  # None: no figure changed since start
        assert [r["memory"] for r in info] == ["rss", "rss"] and total == sum(r["memory_bytes"] for r in info), ranks
        for r in info:
            assert abs(r["memory_bytes"] - _rss(r["pid"])) < 0.02 * _rss(r["pid"]), (r, _rss(r["pid"]))
            assert _rss(os.getpid()) > 1.2 * r["memory_bytes"], (r, _rss(os.getpid()))
        del ballast
        assert fo.memory_report(every_s=3600)[1] is None  # not handed out again before every_s

        # checkpoint folders: as if this driver ran on a machine of its own, both actors get them
        # relayed; in a folder only this process sees (/proc/self/fd/N is another file in theirs)
        fo._here = [False, False]
        assert fo._relay("load_adapter", (shared / "x", False), {})[0][1][0][0] == shared / "x"  # shared: as it is
        (tmp_path / "private").mkdir()
        fd = os.open(tmp_path / "private", os.O_RDONLY | os.O_DIRECTORY)
        private = Path(f"/proc/self/fd/{fd}")
        rng = np.random.default_rng(0)
        datums = []
        for n in (7, 12):
            seq = rng.integers(0, 512, n + 1)
            datums.append(Datum(seq[:-1], {"target_tokens": seq[1:], "weights": np.ones(n, np.float32)}))

        def logprobs(s):
            return fo.forward_backward([ForwardBackwardInput(s, datums, forward_only=True)])[0].logprobs

        for _ in range(2):
            fo.forward_backward([ForwardBackwardInput(slot, datums)])
            fo.optim_step(slot, AdamParams(learning_rate=2e-2))
        folder = private / "ckpt"
        assert fo.save_adapter(slot, folder, True) == folder
        assert sorted(f.name for f in (tmp_path / "private" / "ckpt").iterdir()) == [
            "adapter.safetensors", "metadata.json", "optimizer.safetensors"]
        with pytest.raises(FileExistsError, match="already exists"):
            fo.save_adapter(slot, folder, True)
        assert fo.checkpoint_kind_matches(slot, folder) is True  # rank 0 only, relayed too
        loaded = fo.load_adapter(folder, True)
        trained = logprobs(slot)
        for a, b in zip(logprobs(loaded), trained):
            np.testing.assert_allclose(a, b, atol=1e-6)
        assert max(float(np.abs(a - b).max()) for a, b in zip(logprobs(0), trained)) > 1e-3  # it trained
        with pytest.raises((ValueError, FileNotFoundError), match=re.escape(str(private / "missing"))) as e:
            fo.load_adapter(private / "missing", False)  # the error names this machine's path
        assert "ember-relay" not in str(e.value)
        assert fo.create_adapter(LoraConfig(rank=8)) == loaded + 1  # in step
        os.close(fd)

        # a local --storage root that a node does not see is refused, naming the node
        with pytest.raises(RuntimeError, match=r"--storage .* is not the same folder on node .* \(rank 1\)"):
            try:
                ray.get(fo._actors[1].check_shared.remote(str(shared), "no-such-file", "token"))
            except ray.exceptions.RayTaskError as err:
                raise err.cause from None
    finally:
        fo.stop()
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_server(ray_cluster, tmp_path_factory):
    flags = ["--nproc", "2", "--ep", "2", "--ray", ray_cluster.address]
    with moe_server(tmp_path_factory.mktemp("ray"), flags) as server:
        yield server


def _engine(server, base_model: str = MOE):
    from ember.store import Store

    store = Store.open(server.database_url, run_migrations=False)
    try:
        return {e.base_model: e for e in store.engines()}.get(base_model)
    finally:
        store.close()


def _engine_ranks(server, base_model: str = MOE) -> list[dict]:
    e = _engine(server, base_model)
    return list(e.ranks["ranks"]) if e is not None and e.ranks and e.status == "ready" else []


def test_sdk_against_an_engine_on_two_ray_nodes(ray_server):
    import subprocess
    import sys

    from tests.conformance.conftest import run_scenario
    from tests.live_server import REPO

    ranks = _engine_ranks(ray_server)
    assert [r["rank"] for r in ranks] == [0, 1], ranks
    assert len({r["node_id"] for r in ranks}) == 2, ranks  # one CPU per node: the ranks span both nodes
    out = subprocess.run([sys.executable, "-m", "ember.cli", "status", "--database-url", ray_server.database_url],
                         capture_output=True, text=True, check=True, cwd=REPO).stdout
    assert "2 processes" in out and all(f"pid={r['pid']} cpu node=" in out for r in ranks), out
    assert "ray: 2 nodes, 2 actors, 0 GPUs" in out, out
    # each rank's memory is its actor's own resident set (not the engine driver's), as is the sum
    engine = _engine(ray_server)
    for r in ranks:
        assert r["memory"] == "rss" and f"pid={r['pid']} cpu node={r['node']} rss={r['memory_bytes'] / 2**20:.1f}MiB" in out
        assert abs(r["memory_bytes"] - _rss(r["pid"])) < 0.05 * _rss(r["pid"]), (r, _rss(r["pid"]))
    assert engine.memory_bytes == sum(r["memory_bytes"] for r in ranks), (engine.memory_bytes, ranks)
    assert f"memory={engine.memory_bytes / 2**20:.1f}MiB" in out, out
    run_scenario(ray_server, "s_sharded", timeout_s=400)
    # the figures the actors sent with their calls reach the record (at the next heartbeats)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        after, engine = _engine_ranks(ray_server), _engine(ray_server)
        if all(a["memory_bytes"] != r["memory_bytes"] for a, r in zip(after, ranks)) and \
                engine.memory_bytes == sum(a["memory_bytes"] for a in after):
            break
        time.sleep(0.5)
    else:
        raise AssertionError(f"the ranks' memory was not updated: {ranks} -> {after}, engine {engine.memory_bytes}")
    for a in after:
        assert abs(a["memory_bytes"] - _rss(a["pid"])) < 0.05 * _rss(a["pid"]), (a, _rss(a["pid"]))


def test_a_killed_actor_restarts_the_engine(ray_cluster, ray_server):
    import ray

    from tests.conformance.conftest import run_scenario
    from tests.live_server import wait_ready

    before = _engine_ranks(ray_server)
    assert len(before) == 2, before
    ray.init(address=ray_cluster.address, namespace="ember", log_to_driver=False)
    try:
        names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if f"{MOE}/rank 1/" in a["name"]]
        assert len(names) == 1, names
        ray.kill(ray.get_actor(names[0], namespace="ember"))
    finally:
        ray.shutdown()
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        after = _engine_ranks(ray_server)
        if len(after) == 2 and not {r["pid"] for r in after} & {r["pid"] for r in before}:
            break
        time.sleep(0.5)
    else:
        raise AssertionError(f"engine actors {before} were not replaced: {_engine_ranks(ray_server)}")
    wait_ready(ray_server.base_url, ray_server.proc, ray_server.log, engines=True)
    run_scenario(ray_server, "s_sharded", timeout_s=400)


DENSE, LLAMA = "tiny-qwen3", "tiny-llama"


def _add_node(cluster, name: str):
    node = cluster.add_node(num_cpus=1, resources={name: 1})
    cluster.wait_for_nodes()
    return node


@pytest.fixture(scope="module")
def ray_models(ray_cluster, ray_server, tmp_path_factory):
    """Two more nodes (one CPU each) and a second ``ember serve --ray`` on the same cluster, next
    to ``ray_server`` (which holds the first two): two base models of other families, one actor
    each (``--nproc 1``), checkpoints in an fsspec URL (``file://``: through fsspec, and no folder
    of the driver's machine that the actors' nodes see)."""
    for name in ("node_c", "node_d"):
        _add_node(ray_cluster, name)
    root = tmp_path_factory.mktemp("ray-models")
    storage = f"file://{root / 'bucket'}"
    with models_server(root, {DENSE: ("qwen3", 5), LLAMA: ("llama", 6)},
                       ["--cpu-threads", "1", "--nproc", "1", "--ray", ray_cluster.address], storage) as server:
        yield server


def _client(server):
    import tinker

    return tinker.ServiceClient(base_url=server.base_url, api_key=server.keys["alice"])


def _datums(seed: int):
    from tinker import types

    rng = np.random.default_rng(seed)
    out = []
    for n in (9, 5):
        seq = rng.integers(0, 512, n + 1).tolist()
        out.append(types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]),
                               loss_fn_inputs={"target_tokens": seq[1:], "weights": [1.0] * n}))
    return out


def _logprobs(tc, data) -> list[np.ndarray]:
    return [np.asarray(o["logprobs"].to_numpy()) for o in tc.forward(data, "cross_entropy").result().loss_fn_outputs]


def test_two_base_models_share_the_cluster(ray_cluster, ray_server, ray_models):
    """Each base model's engine has its own actor and placement group, on a node the other
    engines leave free; each answers forward (transformers' logprobs) and sample (the sampler's
    logprobs are the trainer's); ``ember status`` lists both with their actors' memory."""
    import subprocess
    import sys

    import torch
    import transformers
    from tinker import types

    from tests.live_server import REPO

    engines = {m: _engine_ranks(ray_models, m) for m in (DENSE, LLAMA)}
    assert all(len(r) == 1 for r in engines.values()), engines
    nodes = {m: r[0]["node_id"] for m, r in engines.items()}
    moe_nodes = {r["node_id"] for r in _engine_ranks(ray_server)}
    assert len(set(nodes.values())) == 2 and not set(nodes.values()) & moe_nodes, (nodes, moe_nodes)
    out = subprocess.run([sys.executable, "-m", "ember.cli", "status", "--database-url", ray_models.database_url],
                         capture_output=True, text=True, check=True, cwd=REPO).stdout
    assert out.count("ray: 1 nodes, 1 actors, 0 GPUs") == 2, out
    for m, (r,) in engines.items():
        assert f"{m}: ready" in out and f"pid={r['pid']} cpu node={r['node']} rss=" in out, out

    sc = _client(ray_models)
    data = _datums(1)
    for m in (DENSE, LLAMA):
        tc = sc.create_lora_training_client(base_model=m, rank=4, seed=0)
        hf = transformers.AutoModelForCausalLM.from_pretrained(ray_models.models[m], dtype=torch.float32,
                                                               attn_implementation="eager").eval()
        for d, lp in zip(data, _logprobs(tc, data)):
            with torch.no_grad():
                logits = hf(torch.tensor([d.model_input.to_ints()])).logits[0]
            ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(d.loss_fn_inputs["target_tokens"].data)[:, None])
            np.testing.assert_allclose(lp, ref[:, 0].numpy(), atol=2e-4, rtol=0)
        prompt = data[0].model_input.to_ints()
        seq = sc.create_sampling_client(base_model=m).sample(
            types.ModelInput.from_ints(prompt), num_samples=1,
            sampling_params=types.SamplingParams(max_tokens=5, seed=3, temperature=1.0)).result().sequences[0]
        assert len(seq.tokens) == 5, seq
        full = prompt + list(seq.tokens)
        datum = types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                            loss_fn_inputs={"target_tokens": full[1:], "weights": [1.0] * (len(full) - 1)})
        np.testing.assert_allclose(seq.logprobs, _logprobs(tc, [datum])[0][len(prompt) - 1:], atol=1e-4)


def _relayed(server) -> list[str]:
    """The calls whose checkpoint folder the server's engines relayed to an actor (their log)."""
    import json

    calls = []
    for line in server.log.read_text().splitlines():
        if '"checkpoint folder relayed"' in line:
            calls.append(json.loads(line)["call"])
    return calls


def test_a_checkpoint_written_on_one_node_is_loaded_on_another(ray_cluster, ray_server, ray_models):
    """An engine's actor saves a checkpoint (state, sampler weights, a PEFT export) into the
    fsspec storage; its node is then lost (``Cluster.remove_node``), the engine restarts and is
    placed on a node added for it; there the checkpoint loads (the same logprobs, the same seeded
    samples) and its files download through the API, byte for byte what was stored."""
    import json
    import urllib.request
    from urllib.parse import quote

    from safetensors.numpy import load as load_safetensors
    from tinker import types

    from ember.storage import Storage
    from ember.store import Store
    from tests.live_server import wait_ready

    # The local cluster's nodes share one IP, so each driver (an engine process) joins any of
    # them: move the model whose actor's node holds no driver (losing it must not end one).
    drivers = {_engine(server, m).ranks["driver_node_id"] for server, m in
               ((ray_server, MOE), (ray_models, DENSE), (ray_models, LLAMA))}
    movable = [m for m in (DENSE, LLAMA) if _engine_ranks(ray_models, m)[0]["node_id"] not in drivers]
    assert movable, (drivers, {m: _engine_ranks(ray_models, m) for m in (DENSE, LLAMA)})
    model = movable[0]
    sc = _client(ray_models)
    data = _datums(2)
    tc = sc.create_lora_training_client(base_model=model, rank=4, seed=1)
    for _ in range(2):
        tc.forward_backward(data, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    relayed = len(_relayed(ray_models))
    state = tc.save_state("moved").result()
    sampler_path = tc.save_weights_for_sampler("moved").result().path
    export = tc.save_weights_external("moved").result()
    saved = _logprobs(tc, data)
    prompt = types.ModelInput.from_ints(data[0].model_input.to_ints())
    params = types.SamplingParams(max_tokens=6, seed=5, temperature=1.0)
    drawn = [s.tokens for s in sc.create_sampling_client(model_path=sampler_path).sample(
        prompt, num_samples=2, sampling_params=params).result().sequences]
    # the actor is on another node than its driver: it wrote the folders on its node, and they
    # reached the driver (and from there the storage) through Ray
    assert {"save_adapter", "export_peft", "load_sampler"} <= set(_relayed(ray_models)[relayed:]), _relayed(ray_models)

    (before,) = _engine_ranks(ray_models, model)
    lost = next(n for n in ray_cluster.list_all_nodes() if n.node_id == before["node_id"])
    ray_cluster.remove_node(lost)
    _add_node(ray_cluster, "node_e")
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        after = _engine_ranks(ray_models, model)
        if after and after[0]["pid"] != before["pid"]:
            break
        time.sleep(0.5)
    else:
        raise AssertionError(f"the engine was not placed again: {before} -> {_engine_ranks(ray_models, model)}")
    assert after[0]["node_id"] != before["node_id"], (before, after)
    wait_ready(ray_models.base_url, ray_models.proc, ray_models.log, engines=True)

    relayed = len(_relayed(ray_models))
    resumed = sc.create_training_client_from_state_with_optimizer(state.path).result()
    for a, b in zip(_logprobs(resumed, data), saved):
        np.testing.assert_allclose(a, b, atol=1e-6)
    again = [s.tokens for s in sc.create_sampling_client(model_path=sampler_path).sample(
        prompt, num_samples=2, sampling_params=params).result().sequences]
    assert again == drawn
    if after[0]["node_id"] != _engine(ray_models, model).ranks["driver_node_id"]:  # else read in place
        assert {"load_adapter", "load_sampler"} <= set(_relayed(ray_models)[relayed:]), _relayed(ray_models)

    # downloads through the API: the SDK's export URLs, and the console's for the training state
    store = Store.open(ray_models.database_url, run_migrations=False)
    try:
        uris = {p: store.get_checkpoint(p, None).uri for p in (state.path, export.path)}
    finally:
        store.close()
    storage = Storage(ray_models.storage)
    assert all(uri.startswith("file://") for uri in uris.values()), uris

    def stored(uri, name):
        with storage.open_file(uri, name) as fh:
            return fh.read()

    urls = sc.create_rest_client().get_external_weights_urls(export.path).result().urls
    files = {name: urllib.request.urlopen(url).read() for name, url in urls.items()}
    assert set(files) == {"adapter_model.safetensors", "adapter_config.json"}
    assert all(files[n] == stored(uris[export.path], n) for n in files)
    assert json.loads(files["adapter_config.json"])["r"] == 4
    assert any(k.endswith("lora_B.weight") and np.abs(v).max() > 0
               for k, v in load_safetensors(files["adapter_model.safetensors"]).items())  # trained, not zeros
    req = urllib.request.Request(f"{ray_models.base_url}/console/api/checkpoint_files?path={quote(state.path)}",
                                 headers={"X-API-Key": ray_models.keys["alice"]})
    listed = json.load(urllib.request.urlopen(req))["files"]
    assert {f["name"] for f in listed} == {"adapter.safetensors", "optimizer.safetensors", "metadata.json"}, listed
    for f in listed:
        assert urllib.request.urlopen(f["url"]).read() == stored(uris[state.path], f["name"]), f["name"]
