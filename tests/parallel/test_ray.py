"""``ember serve --ray``: the placement rule (pure, on a simulated 4 nodes x 8 GPUs), then a local
Ray cluster of two logical nodes (``ray.cluster_utils.Cluster``, one CPU each, told apart by a
custom resource) serving the tiny MoE model with ``--device cpu --nproc 2 --ep 2``: the SDK scenario
(tests/conformance/scenarios/s_sharded.py: parity, training and sampling, checkpoints), then one
actor killed with ``ray.kill``: the engine stops, the supervisor starts it anew, and the scenario
passes again."""

from __future__ import annotations

import time

import pytest

from ember.engine.ray_engine import assign_ranks
from tests.parallel.serving import MOE, moe_server


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


def test_the_supervisor_passes_ray_to_the_engine():
    from types import SimpleNamespace

    from ember.server.supervisor import EngineOptions, EngineSupervisor

    models = {"m": SimpleNamespace(path="/models/m")}
    cmd = EngineSupervisor(None, models, EngineOptions("sqlite://", "/s", ray="auto")).command("m")
    assert cmd[cmd.index("--ray") + 1] == "auto" and cmd[cmd.index("--nproc") + 1] == "1"  # even one rank is an actor
    assert "--ray" not in EngineSupervisor(None, models, EngineOptions("sqlite://", "/s", nproc=2)).command("m")


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
    actors in step; an attribute of rank 0's worker is read through its actor."""
    import ray

    from ember.core.adapters import LoraConfig
    from ember.core.optim import AdamParams
    from ember.engine.builtin import build_model
    from ember.engine.ray_engine import RayFanOut
    from ember.types import InvalidRequest

    path = str(build_model(tmp_path / MOE, "qwen3_moe", seed=2))
    fo = RayFanOut.start(ray_cluster.address, dict(
        model_path=path, device="cpu", dtype="float32", nproc=2, ep=2, tp=1, expert_fsdp=False, cpu_threads=1,
        log_level="WARNING", log_format="text", kwargs=dict(max_adapters=4, max_rank=16), name="fanout-test"))
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
    finally:
        fo.stop()
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_server(ray_cluster, tmp_path_factory):
    flags = ["--nproc", "2", "--ep", "2", "--ray", ray_cluster.address]
    with moe_server(tmp_path_factory.mktemp("ray"), flags) as server:
        yield server


def _engine_ranks(server) -> list[dict]:
    from ember.store import Store

    store = Store.open(server.database_url, run_migrations=False)
    try:
        engines = {e.base_model: e for e in store.engines()}
        e = engines.get(MOE)
        return list(e.ranks["ranks"]) if e is not None and e.ranks and e.status == "ready" else []
    finally:
        store.close()


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
    run_scenario(ray_server, "s_sharded", timeout_s=400)


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
