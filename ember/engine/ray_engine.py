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

Checkpoint folders. The worker's calls that read or write a folder (:data:`FOLDER_ARGS`) name a
path of this process's machine: a checkpoint in a local ``--storage`` root, or a temporary folder
(a checkpoint staged for an fsspec upload or downloaded from one, a parked sampler). An actor on
another node reads and writes such a path directly only where every node sees it: under the
folders in ``opts["shared"]`` (a local ``--storage`` root, which :meth:`RayFanOut.start` checks
every actor sees, with a file it writes there). Any other path is *relayed*: its files go to the
actor through Ray's object store, into a temporary folder of the actor's node, and a folder the
actor writes comes back as bytes and is written here. So an fsspec ``--storage`` needs no folder
shared between the nodes (only this process talks to the object store).

Memory. Every actor reports the memory it holds with each call's result (``torch.cuda.
memory_allocated`` of its GPU on CUDA, its process's resident set size on the CPU);
:meth:`RayFanOut.memory_report` gives the engine's heartbeat their sum and the ranks' record with
each actor's own figure (``memory_bytes``, labelled by ``memory``: ``cuda_allocated`` or ``rss``).
"""

from __future__ import annotations

import inspect
import logging
import os
import pickle
import shutil
import socket
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import ray
import torch
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ember.core.checkpoint import atomic_dir
from ember.engine.ranks import _DETOKENIZE, ALIKE, COLLECTIVE, ON_RANK0, _resync, _seeded
from ember.engine.sharded import ShardedWorker

log = logging.getLogger("ember.engine")
PLACEMENT_TIMEOUT_S = 600.0  # how long the engine waits for the cluster to hold its placement group
MEMORY_REPORT_S = 2.0  # at most this often the ranks' memory figures are handed to the heartbeat
# The worker's calls whose ``path`` argument is a checkpoint folder they read or write.
FOLDER_ARGS = {"save_adapter": "write", "export_peft": "write", "load_adapter": "read", "load_sampler": "read",
               "import_peft": "read", "checkpoint_kind_matches": "read"}


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


@dataclass(frozen=True)
class _Relayed:
    """A folder argument the actor's node may not see: ``original`` (the path on the driver's
    machine) and, to read it, ``files`` (an object ref of :func:`_pack`'s dict; None where the
    folder does not exist); ``write``: the actor writes a folder of its own and sends its files back."""

    original: str
    files: object = None
    write: bool = False


def _pack(folder: Path) -> dict[str, bytes] | None:
    """The files below ``folder`` by relative path (None if it is not a folder)."""
    if not folder.is_dir():
        return None
    return {f.relative_to(folder).as_posix(): f.read_bytes() for f in sorted(folder.rglob("*")) if f.is_file()}


def _unpack(files: dict[str, bytes], folder: Path) -> None:
    for rel, data in files.items():
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise ValueError(f"bad relayed file name {rel!r}")
        target = folder / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)


def _bind(name: str, args: tuple, kwargs: dict) -> inspect.BoundArguments:
    """``args``/``kwargs`` of the worker's call ``name`` by parameter (defaults applied)."""
    bound = inspect.signature(getattr(ShardedWorker, name)).bind(None, *args, **kwargs)
    bound.apply_defaults()
    return bound


def _with_path(bound: inspect.BoundArguments, path) -> tuple[tuple, dict]:
    bound.arguments["path"] = path
    return tuple(bound.args[1:]), dict(bound.kwargs)


def _renamed(e: BaseException, local: Path, original: str) -> BaseException:
    """``e`` with the actor's temporary folder named as the driver's path in its message."""
    text = str(e)
    if str(local) not in text:
        return e
    try:
        return type(e)(text.replace(str(local), original))
    except Exception:  # noqa: BLE001 - an exception type with other arguments: keep it as it is
        return e


class _LocalFolder:
    """The folder argument of one call on an actor: a :class:`_Relayed` one becomes a temporary
    folder of this node (filled with the driver's files to read; sent back after a write)."""

    def __init__(self, name: str, args: tuple, kwargs: dict):
        self.args, self.kwargs = args, kwargs
        self.relayed: _Relayed | None = None
        self._tmp: Path | None = None
        if not any(isinstance(a, _Relayed) for a in (*args, *kwargs.values())):
            return
        bound = _bind(name, args, kwargs)  # the driver bound them too: only its path is _Relayed
        relayed = self.relayed = bound.arguments["path"]
        self._tmp = Path(tempfile.mkdtemp(prefix="ember-relay-"))
        self.local = self._tmp / "folder"
        if relayed.files is not None:
            self.local.mkdir()
            _unpack(ray.get(relayed.files), self.local)
        self.args, self.kwargs = _with_path(bound, str(self.local))

    def result(self, out):
        """``out`` with the temporary folder named as the driver's path."""
        if self.relayed is not None and isinstance(out, (str, Path)) and Path(out) == self.local:
            return type(out)(self.relayed.original)
        return out

    def written(self) -> dict[str, bytes] | None:
        """The files the call wrote (a relayed write), to send back."""
        return _pack(self.local) if self.relayed is not None and self.relayed.write else None

    def error(self, e: BaseException) -> BaseException:
        return _renamed(e, self.local, self.relayed.original) if self.relayed is not None else e

    def close(self) -> None:
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)


@ray.remote(concurrency_groups={"watch": 1})
class RankActor:
    """One rank of the engine: its process group membership and its shard of the model."""

    def __init__(self, rank: int, opts: dict):
        self.rank, self.opts = rank, opts
        self.worker = None
        self._device = torch.device("cpu")  # start() sets the rank's own
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
        self._device = torch.device(device)
        gpus = ray.get_gpu_ids()
        return {"rank": self.rank, "pid": os.getpid(), "device": f"cuda:{gpus[0]}" if cuda and gpus else device,
                "node": ray.util.get_node_ip_address(), "node_id": ray.get_runtime_context().get_node_id(),
                "memory": "cuda_allocated" if cuda else "rss", "memory_bytes": self.memory()}

    def memory(self) -> int:
        """Bytes this actor holds: allocated memory of its GPU, or its process's resident set size."""
        from ember.engine.service import memory_in_use

        return memory_in_use(self._device)

    def check_shared(self, folder: str, name: str, token: str) -> None:
        """Raise unless ``folder/name`` holds ``token`` here: the driver wrote it into a folder
        every node must see alike (a local ``--storage`` root)."""
        f = Path(folder) / name
        try:
            seen = f.read_text()
        except OSError:
            seen = None
        if seen != token:
            raise RuntimeError(
                f"--storage {folder} is not the same folder on node {ray.util.get_node_ip_address()} (rank {self.rank}) "
                f"as where the engine runs: {f}, written there, is {'missing' if seen is None else 'different'} here. "
                "Mount the storage at the same path on every node of the Ray cluster (NFS, Lustre, ...), or pass "
                "an fsspec URL as --storage (docs/cluster.md)")

    def call(self, name: str, args: tuple, kwargs: dict):
        """Run one of rank 0's calls: ``(status, value, memory_bytes, files)``: ``("ok", result)``
        (rank 0's result; None on the others) or ``("error", exception)``; the memory this actor
        holds afterwards; the files of a relayed folder it wrote (else None)."""
        if kwargs.get("detokenize") == _DETOKENIZE:
            kwargs = {**kwargs, "detokenize": self._detok}
        folder = None
        try:
            try:
                folder = _LocalFolder(name, args, kwargs)
                out = getattr(self.worker, name)(*folder.args, **folder.kwargs)
            except ALIKE as e:
                return "error", _picklable(folder.error(e) if folder else e), self.memory(), None
            except Exception as e:
                log.exception("a call failed on this rank", extra={"call": name, "rank": self.rank})
                _resync(self.worker.parallel, name)  # exits this process where the other ranks did not fail too
                return "error", _picklable(folder.error(e) if folder else e), self.memory(), None
            return "ok", (folder.result(out) if self.rank == 0 else None), self.memory(), folder.written()
        finally:
            if folder is not None:
                folder.close()

    def get(self, path: Sequence[str], args: tuple | None = None, kwargs: dict | None = None):
        """An attribute of this rank's worker (``path``, dotted), called with ``args`` if given."""
        obj = self.worker
        for part in path:
            obj = getattr(obj, part)
        if args is None:
            return obj
        folder = _LocalFolder(path[0], args, kwargs or {})
        try:
            return folder.result(obj(*folder.args, **folder.kwargs))
        except Exception as e:  # noqa: BLE001 - raised again, naming the driver's path
            raise folder.error(e) from None
        finally:
            folder.close()

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

    def __init__(self, actors: list, ranks: dict, pg=None, shared: Sequence[str] = ()):
        self._actors, self._pg = actors, pg
        self.ranks = ranks
        self.device = torch.device("cpu")  # the model lives in the actors (memory_report: their memory)
        self.bank = _OnRank0(actors[0], ("bank",))
        self._stopping = False
        info = ranks["ranks"]
        self._driver_node = ranks.get("driver_node_id")
        # per actor (in rank order): whether it is on this process's machine, so sees its paths
        self._here = [r.get("node_id") == self._driver_node for r in info]
        self._shared = [Path(f).expanduser().resolve() for f in shared]
        self._memory = [r.get("memory_bytes") for r in info]
        self._reported = time.monotonic()  # the ranks' record as given to engine_ranks at start
        self._watches = [a.watch.remote() for a in actors]
        threading.Thread(target=self._watch, name="engine-actors", daemon=True).start()

    @classmethod
    def start(cls, address: str, opts: dict) -> RayFanOut:
        """Join the Ray cluster at ``address``, place and start the engine's actors. ``opts``:
        model_path, device, dtype (a torch dtype's name), nproc, ep, tp, expert_fsdp, cpu_threads,
        log_level, log_format, kwargs (the worker's); shared (optional): local folders every
        node must see at the same path (checked)."""
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
        shared = list(opts.get("shared") or ())
        for folder in shared:  # before the process group, which would wait for a rank that failed here
            _check_shared(actors, folder)
        addr, port = ray.get(actors[0].address.remote())
        try:
            info = ray.get([a.start.remote(addr, port) for a in actors])
        except ray.exceptions.RayTaskError as e:
            raise (e.cause if isinstance(e.cause, BaseException) else RuntimeError(str(e))) from None
        ranks = {"ep": opts["ep"], "tp": opts["tp"], "ray": address, "ranks": info,
                 "driver_node_id": ray.get_runtime_context().get_node_id()}
        log.info("engine actors started", extra={"ray": address, "ranks": info})
        return cls(actors, ranks, pg, shared)

    def _watch(self) -> None:
        ray.wait(self._watches, num_returns=1, timeout=None)
        if not self._stopping:
            _actor_died("watch")

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        if name in ON_RANK0:
            if name in FOLDER_ARGS:  # reads a folder: relayed to rank 0 where its node does not see it
                def on_rank0(*args, **kwargs):
                    (args, kwargs), = self._relay(name, args, kwargs, ranks=1)[0]
                    return _result(self._actors[0].get.remote((name,), args, kwargs))

                return on_rank0
            return _OnRank0(self._actors[0], (name,))
        if name not in COLLECTIVE:
            return _OnRank0(self._actors[0], (name,)).value()

        def call(*args, **kwargs):
            if name == "sample":  # "no seed" draws one seed here, for every rank
                args = ([_seeded(r) for r in args[0]], *args[1:])
            sent = {k: (_DETOKENIZE if k == "detokenize" and v is not None else v) for k, v in kwargs.items()}
            return self.fan_out(name, args, sent)

        return call

    def _sees(self, i: int, path: Path) -> bool:
        """Whether actor ``i`` reads and writes ``path`` (a path of this machine) directly."""
        return self._here[i] or any(path.is_relative_to(root) for root in self._shared)

    def _relay(self, name: str, args: tuple, kwargs: dict, ranks: int | None = None
               ) -> tuple[list[tuple[tuple, dict]], dict | None]:
        """Each actor's (of the first ``ranks``; all by default) ``(args, kwargs)`` of the call
        ``name``: its folder argument as it is, or :class:`_Relayed` for an actor that does not
        see it; and, for a relayed write, where the driver writes the folder (``{"path",
        "overwrite"}``), else None."""
        n = len(self._actors) if ranks is None else ranks
        same = [(args, kwargs)] * n
        if name not in FOLDER_ARGS:
            return same, None
        bound = _bind(name, args, kwargs)
        original = bound.arguments["path"]
        path = Path(original).expanduser().absolute()
        away = [i for i in range(n) if not self._sees(i, path.resolve())]
        if not away:
            return same, None
        if FOLDER_ARGS[name] == "write":
            overwrite = bool(bound.arguments.get("overwrite", False))
            if path.exists() and not overwrite:  # as atomic_dir would say on the actor, before any rank runs
                raise FileExistsError(f"{path} already exists")
            relayed, target = _Relayed(str(original), write=True), {"path": path, "overwrite": overwrite}
        else:
            files = _pack(path)
            relayed, target = _Relayed(str(original), ray.put(files) if files is not None else None), None
        moved = _with_path(bound, relayed)
        log.info("checkpoint folder relayed", extra={"call": name, "folder": str(path), "ranks": away})
        return [moved if i in away else (args, kwargs) for i in range(n)], target

    def fan_out(self, name: str, args: tuple, kwargs: dict):
        """Run ``name`` on every actor; rank 0's result, or rank 0's error raised here."""
        calls, target = self._relay(name, args, kwargs)
        refs = [a.call.remote(name, *c) for a, c in zip(self._actors, calls)]
        pending = list(refs)
        while pending:  # an actor that dies stops the engine at once, not after the others' collective timeout
            ready, pending = ray.wait(pending, num_returns=1)
            for ref in ready:
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError:
                    _actor_died(f"rank {refs.index(ref)}")
        results = ray.get(refs)
        self._memory = [r[2] for r in results]
        status, value, _, files = results[0]
        if status == "error":
            raise value
        if target is not None and files is not None:  # rank 0 wrote the folder on its node: write it here
            with atomic_dir(target["path"], target["overwrite"]) as tmp:
                _unpack(files, tmp)
        return value

    def memory_report(self, every_s: float = MEMORY_REPORT_S) -> tuple[int, dict | None]:
        """``(bytes, ranks)``: the memory the engine's actors hold (the sum of what each reported
        with its last call), and the ranks' record with each one's figure when a figure changed
        and ``every_s`` passed since it was last returned (for ``engine_ranks``), else None."""
        total = sum(m for m in self._memory if m is not None)
        now = time.monotonic()
        info = self.ranks["ranks"]
        if now - self._reported < every_s or all(r.get("memory_bytes") == m for r, m in zip(info, self._memory)):
            return total, None
        self.ranks = {**self.ranks, "ranks": [{**r, "memory_bytes": m} for r, m in zip(info, self._memory)]}
        self._reported = now
        return total, self.ranks

    def stop(self) -> None:
        """Release the actors and their placement group."""
        self._stopping = True
        for a in self._actors:
            ray.kill(a)
        if self._pg is not None:
            remove_placement_group(self._pg)


def _check_shared(actors: list, folder: str) -> None:
    """Raise (naming the node) unless every actor sees a file written into ``folder`` here."""
    root = Path(folder).expanduser().resolve()
    root.mkdir(parents=True, exist_ok=True)
    name, token = f".ember-node-check-{os.getpid()}-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    (root / name).write_text(token)
    try:
        ray.get([a.check_shared.remote(str(root), name, token) for a in actors])
    except ray.exceptions.RayTaskError as e:
        raise (e.cause if isinstance(e.cause, BaseException) else RuntimeError(str(e))) from None
    finally:
        (root / name).unlink(missing_ok=True)
