"""A sharded engine whose ranks are Ray actors (``ember serve --ray ADDRESS|auto``).

The engine service process (started by the supervisor, as on one machine) keeps the store, the
scheduler and the doorbell, and joins the Ray cluster as a driver. It holds no model: it creates
one placement group of ``nproc`` bundles (``{"CPU": 1}`` on ``--device cpu``, ``{"GPU": 1, "CPU":
1}`` on cuda; ``PACK``), orders the bundles by node (:func:`assign_ranks`: consecutive ranks share
a node and a tensor-parallel group never crosses one), and starts one :class:`RankActor` per rank.
Rank 0's actor names its node's address and a free port; every actor joins the process group
there (``cpu:gloo,cuda:nccl``, or ``gloo`` on the CPU) and loads its
:class:`~ember.engine.sharded.ShardedWorker`. The data of a step moves over torch.distributed
between the actors, as on one machine.

:class:`RayFanOut` is the service's worker: a call that touches the model (the same
:data:`~ember.engine.ranks.COLLECTIVE` set as :class:`~ember.engine.ranks.FanOut`) is sent to every
actor at once and rank 0's result is returned; anything else is asked of rank 0's worker. Errors
keep the rules of :mod:`ember.engine.ranks`: an error every rank raises alike (:data:`ALIKE`) or
one every rank reached the resync barrier with is rank 0's error, raised here; an actor that dies
(killed, its node lost, or out of step after an error on some ranks only) stops this process, so
the supervisor fails the in-flight requests and starts the engine anew (Ray removes this driver's
actors and placement group with it).
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import threading
from collections import Counter
from collections.abc import Sequence
from datetime import timedelta

import ray
import torch
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ember.engine.ranks import _DETOKENIZE, ALIKE, COLLECTIVE, ON_RANK0, _resync, _seeded

log = logging.getLogger("ember.engine")
PLACEMENT_TIMEOUT_S = 600.0  # how long the engine waits for the cluster to hold its placement group


def assign_ranks(bundle_nodes: Sequence[str], tp: int = 1) -> list[int]:
    """The bundle of each rank: the bundles grouped by node (nodes in the order of their first
    bundle, a node's bundles in index order), so consecutive ranks share a node and every group
    of ``tp`` consecutive ranks (a tensor-parallel group) lies inside one node. ``ValueError``
    where a node holds a number of bundles that is not a multiple of ``tp``."""
    if tp < 1:
        raise ValueError(f"tp must be at least 1, got {tp}")
    counts = Counter(bundle_nodes)
    split = {node: n for node, n in counts.items() if n % tp}
    if split:
        raise ValueError(
            "a tensor-parallel group would cross nodes: the placement group put "
            + ", ".join(f"{n} bundles on node {node}" for node, n in split.items())
            + f", not a multiple of --tp {tp}; give every node a multiple of {tp} GPUs for this engine"
        )
    first = {}
    for i, node in enumerate(bundle_nodes):
        first.setdefault(node, i)
    return sorted(range(len(bundle_nodes)), key=lambda i: (first[bundle_nodes[i]], i))


def _picklable(e: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001 - any failure to pickle: send its text
        return RuntimeError(f"{type(e).__name__}: {e}")


@ray.remote(concurrency_groups={"watch": 1})
class RankActor:
    """One rank of the engine: its process group membership and its shard of the model."""

    def __init__(self, rank: int, opts: dict):
        self.rank, self.opts = rank, opts
        self.worker = None
        self._detokenize = None
        self._stop = threading.Event()
        from ember.jsonlog import setup_logging

        setup_logging(opts["log_level"], opts["log_format"])

    def address(self) -> tuple[str, int]:
        """This node's address and a free port (rank 0: where the process group meets)."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def start(self, addr: str, port: int) -> dict:
        """Join the process group and load this rank's shard; returns what ``ember status`` shows."""
        import torch.distributed as dist

        from ember.dist.mesh import Parallel
        from ember.engine.service import cpu_threads
        from ember.engine.sharded import ShardedWorker

        o = self.opts
        cuda = o["device"].startswith("cuda")
        device = "cuda:0" if cuda else o["device"]  # Ray shows each actor its own GPU only
        if cuda:
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(max(1, cpu_threads(o["cpu_threads"]) // o["nproc"]))
        dist.init_process_group(
            "cpu:gloo,cuda:nccl" if cuda else "gloo", init_method=f"tcp://{addr}:{port}", rank=self.rank,
            world_size=o["nproc"], timeout=timedelta(minutes=10),
        )
        parallel = Parallel(o["ep"], o["tp"])
        log.info("engine rank joined", extra={"rank": self.rank, "world": o["nproc"], "ep": o["ep"], "tp": o["tp"],
                                              "device": device, "node": ray.util.get_node_ip_address()})
        self.worker = ShardedWorker.from_pretrained(o["model_path"], parallel, device, getattr(torch, o["dtype"]),
                                                    expert_fsdp=o["expert_fsdp"], **o["kwargs"])
        gpus = ray.get_gpu_ids()
        return {"rank": self.rank, "pid": os.getpid(), "device": f"cuda:{gpus[0]}" if cuda and gpus else device,
                "node": ray.util.get_node_ip_address(), "node_id": ray.get_runtime_context().get_node_id()}

    def call(self, name: str, args: tuple, kwargs: dict):
        """Run one of rank 0's calls: ``("ok", result)`` (rank 0's result; None on the others) or
        ``("error", exception)``."""
        if kwargs.get("detokenize") == _DETOKENIZE:
            kwargs = {**kwargs, "detokenize": self._detok}
        try:
            out = getattr(self.worker, name)(*args, **kwargs)
        except ALIKE as e:
            return "error", _picklable(e)
        except Exception as e:
            log.exception("a call failed on this rank", extra={"call": name, "rank": self.rank})
            _resync(self.worker.parallel, name)  # exits this process where the other ranks did not fail too
            return "error", _picklable(e)
        return "ok", (out if self.rank == 0 else None)

    def get(self, path: Sequence[str], args: tuple | None = None, kwargs: dict | None = None):
        """An attribute of this rank's worker (``path``, dotted), called with ``args`` if given."""
        obj = self.worker
        for part in path:
            obj = getattr(obj, part)
        return obj(*args, **(kwargs or {})) if args is not None else obj

    def _detok(self, ids) -> str:
        if self._detokenize is None:
            from ember.engine.service import tokenizer_decode

            self._detokenize = tokenizer_decode(self.opts["model_path"])
        return self._detokenize(ids)

    @ray.method(concurrency_group="watch")
    def watch(self) -> None:
        """Never returns: the driver waits on it to learn that this actor died."""
        self._stop.wait()


class _OnRank0:
    """An attribute of rank 0's worker, read (or called) through its actor: ``worker.bank.validate(c)``."""

    def __init__(self, actor, path: tuple[str, ...]):
        self._actor, self._path = actor, path

    def __getattr__(self, name):
        return _OnRank0(self._actor, (*self._path, name))

    def __call__(self, *args, **kwargs):
        return _result(self._actor.get.remote(self._path, args, kwargs))

    def value(self):
        return _result(self._actor.get.remote(self._path))


def _result(ref):
    try:
        return ray.get(ref)
    except ray.exceptions.RayActorError:
        _actor_died("rank 0")
    except ray.exceptions.RayTaskError as e:
        raise (e.cause if isinstance(e.cause, BaseException) else RuntimeError(str(e))) from None


def _actor_died(which: str) -> None:
    log.error("an engine actor died; stopping the engine", extra={"actor": which})
    os._exit(1)


class RayFanOut:
    """The service's worker of an engine on Ray actors (see the module docstring)."""

    def __init__(self, actors: list, ranks: dict, pg=None):
        self._actors, self._pg = actors, pg
        self.ranks = ranks
        self.device = torch.device("cpu")  # the model lives in the actors; memory_in_use reports this process
        self.bank = _OnRank0(actors[0], ("bank",))
        self._stopping = False
        self._watches = [a.watch.remote() for a in actors]
        threading.Thread(target=self._watch, name="engine-actors", daemon=True).start()

    @classmethod
    def start(cls, address: str, opts: dict) -> RayFanOut:
        """Join the Ray cluster at ``address``, place and start the engine's actors. ``opts``:
        model_path, device, dtype (a torch dtype's name), nproc, ep, tp, expert_fsdp, cpu_threads,
        log_level, log_format, kwargs (the worker's)."""
        if not ray.is_initialized():
            ray.init(address=address, namespace="ember", log_to_driver=True)
        n, cuda = opts["nproc"], opts["device"].startswith("cuda")
        bundle = {"GPU": 1, "CPU": 1} if cuda else {"CPU": 1}
        pg = placement_group([dict(bundle) for _ in range(n)], strategy="PACK")
        ready, _ = ray.wait([pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            raise RuntimeError(f"the Ray cluster did not hold {n} bundles of {bundle} within {PLACEMENT_TIMEOUT_S:.0f} s "
                               f"(its resources: {ray.cluster_resources()})")
        nodes = placement_group_table(pg)["bundles_to_node_id"]
        order = assign_ranks([nodes[i] for i in range(n)], opts["tp"])
        resources = {"num_gpus": 1, "num_cpus": 1} if cuda else {"num_cpus": 1}
        name = opts.get("name", "engine")
        actors = [  # named for ray list actors / the dashboard: NAME/rank R/DRIVER PID (unique per engine start)
            RankActor.options(**resources, scheduling_strategy=PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=b), max_restarts=0,
                name=f"{name}/rank {rank}/{os.getpid()}").remote(rank, opts)
            for rank, b in enumerate(order)
        ]
        addr, port = ray.get(actors[0].address.remote())
        try:
            info = ray.get([a.start.remote(addr, port) for a in actors])
        except ray.exceptions.RayTaskError as e:
            raise (e.cause if isinstance(e.cause, BaseException) else RuntimeError(str(e))) from None
        ranks = {"ep": opts["ep"], "tp": opts["tp"], "ray": address, "ranks": info}
        log.info("engine actors started", extra={"ray": address, "ranks": info})
        return cls(actors, ranks, pg)

    def _watch(self) -> None:
        ray.wait(self._watches, num_returns=1, timeout=None)
        if not self._stopping:
            _actor_died("watch")

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        if name in ON_RANK0:
            return _OnRank0(self._actors[0], (name,))
        if name not in COLLECTIVE:
            return _OnRank0(self._actors[0], (name,)).value()

        def call(*args, **kwargs):
            if name == "sample":  # "no seed" draws one seed here, for every rank
                args = ([_seeded(r) for r in args[0]], *args[1:])
            sent = {k: (_DETOKENIZE if k == "detokenize" and v is not None else v) for k, v in kwargs.items()}
            return self.fan_out(name, args, sent)

        return call

    def fan_out(self, name: str, args: tuple, kwargs: dict):
        """Run ``name`` on every actor; rank 0's result, or rank 0's error raised here."""
        refs = [a.call.remote(name, args, kwargs) for a in self._actors]
        pending = list(refs)
        while pending:  # an actor that dies stops the engine at once, not after the others' collective timeout
            ready, pending = ray.wait(pending, num_returns=1)
            for ref in ready:
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError:
                    _actor_died(f"rank {refs.index(ref)}")
        status, value = ray.get(refs[0])
        if status == "error":
            raise value
        return value

    def stop(self) -> None:
        """Release the actors and their placement group."""
        self._stopping = True
        for a in self._actors:
            ray.kill(a)
        if self._pg is not None:
            remove_placement_group(self._pg)
