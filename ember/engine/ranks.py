"""The processes of a sharded engine (``ember serve --nproc N``).

Rank 0 runs the service (store, scheduler) on a :class:`FanOut`, which sends every call that
touches the model or the adapter bank to the other ranks (:func:`follow`) before running it
itself, so every rank makes the same calls with the same arguments in the same order. Rank 0
starts the other ranks (:func:`start_rank`); a rank that dies stops the engine, and a rank exits
when rank 0 is gone.

A call that fails with an error every rank raises alike (the same validation of the same input:
:data:`ALIKE`) leaves the ranks in step, and rank 0 reports it. Any other error may have struck
some ranks only, possibly while the others wait in a collective for them: the ranks that raised
meet in a barrier on a separate gloo group (:func:`_resync`). If every rank is there, they all
failed at the same point and go on (rank 0 reports the error); if one is missing within that
group's timeout (``Parallel.control_group``, a minute), the engine stops (the supervisor fails
the in-flight requests and restarts it) instead of waiting out the collectives' ten-minute timeout.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist

from ember.core.adapters import AdapterBankFull
from ember.dist import comm
from ember.dist.mesh import Parallel
from ember.engine.sharded import ShardedWorker
from ember.types import SampleInput

log = logging.getLogger("ember.engine")

# errors that every rank raises alike for the same call (validation of the request, the bank's
# slots, the checkpoint files): InvalidRequest and InvalidGeneration are ValueErrors
ALIKE = (ValueError, FileNotFoundError, AdapterBankFull)


def start_rank(args, dtype: torch.dtype, kwargs: dict, argv: list[str] | None = None) -> ShardedWorker:
    """Join the engine's process group and load this rank's shard. Rank 0 first starts ranks
    ``1..nproc-1`` (the same command with ``--rank``), and exits if one of them dies (the
    supervisor then fails the in-flight requests and restarts the whole engine); a rank exits
    when rank 0 is gone."""
    cuda = args.device.startswith("cuda")
    if args.rank == 0:
        init = f"tcp://127.0.0.1:{_free_port()}"
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "ember.engine.service", *argv, "--rank", str(r), "--dist-init", init,
                 "--parent-pid", str(os.getpid())],
                stdin=subprocess.DEVNULL,
            )
            for r in range(1, args.nproc)
        ]
        threading.Thread(target=_watch_ranks, args=(procs,), name="engine-ranks", daemon=True).start()
    else:
        init = args.dist_init
        threading.Thread(target=_watch_parent, args=(args.parent_pid,), name="engine-rank0", daemon=True).start()
    device = f"cuda:{args.rank}" if cuda else args.device
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(
        "cpu:gloo,cuda:nccl" if cuda else "gloo", init_method=init, rank=args.rank, world_size=args.nproc,
        timeout=timedelta(minutes=10),
    )
    parallel = Parallel(args.ep, args.tp)
    log.info("engine rank joined",
             extra={"rank": args.rank, "world": args.nproc, "ep": args.ep, "tp": args.tp, "device": device,
                    "expert_fsdp": args.expert_fsdp})
    worker = ShardedWorker.from_pretrained(args.model_path, parallel, device, dtype,
                                           expert_fsdp=args.expert_fsdp, **kwargs)
    if args.rank == 0:
        pids = [os.getpid()] + [p.pid for p in procs]
        devices = [f"cuda:{r}" if cuda else args.device for r in range(args.nproc)]
        worker.ranks = {"ep": args.ep, "tp": args.tp,
                        "ranks": [{"rank": r, "pid": pid, "device": d} for r, (pid, d) in enumerate(zip(pids, devices))]}
    return worker


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _watch_ranks(procs: list[subprocess.Popen]) -> None:
    while True:
        for rank, p in enumerate(procs, start=1):
            code = p.poll()
            if code is not None:
                log.error("engine rank died; stopping the engine", extra={"rank": rank, "exit_code": code})
                for q in procs:
                    if q.poll() is None:
                        q.kill()
                os._exit(1)
        time.sleep(0.5)


def _watch_parent(pid: int | None) -> None:
    while pid is not None:
        if os.getppid() != pid:
            os._exit(1)
        time.sleep(0.5)


# Worker methods that touch the model or the bank: every rank runs them, in the same order.
COLLECTIVE = frozenset({
    "create_adapter", "reset_adapter", "free_adapter", "snapshot_adapter", "forward_backward", "optim_step",
    "sample", "release_sampler", "save_adapter", "load_adapter", "load_sampler", "export_peft", "import_peft",
})
# Worker methods that only read rank 0's state (the service calls them through the fan-out)
ON_RANK0 = frozenset({"validate", "checkpoint_kind_matches"})
_DETOKENIZE = "<detokenize>"


class FanOut:
    """Rank 0's worker: collective calls are sent to every other rank, then run here."""

    def __init__(self, worker: ShardedWorker):
        self._worker = worker

    def __getattr__(self, name):
        attr = getattr(self._worker, name)
        if name not in COLLECTIVE:
            return attr

        def call(*args, **kwargs):
            if name == "sample":  # "no seed" draws one seed here, for every rank
                args = ([_seeded(r) for r in args[0]], *args[1:])
            sent = {k: (_DETOKENIZE if k == "detokenize" and v is not None else v) for k, v in kwargs.items()}
            comm.broadcast_object((name, args, sent))
            try:
                return attr(*args, **kwargs)
            except ALIKE:
                raise
            except Exception:
                _resync(self._worker.parallel, name)
                raise

        return call

    def stop(self) -> None:
        """Release the followers (they return from :func:`follow`)."""
        comm.broadcast_object(None)


def _seeded(req: SampleInput) -> SampleInput:
    if req.params.seed is not None:
        return req
    return replace(req, params=replace(req.params, seed=secrets.randbits(63)))


def follow(worker: ShardedWorker, detokenize=None) -> None:
    """A rank > 0: run rank 0's calls until it stops. A call that fails here failed on rank 0
    too (the same validation of the same input), which reports it."""
    while True:
        msg = comm.broadcast_object(None)
        if msg is None:
            return
        name, args, kwargs = msg
        if kwargs.get("detokenize") == _DETOKENIZE:
            kwargs["detokenize"] = detokenize
        try:
            getattr(worker, name)(*args, **kwargs)
        except ALIKE:  # rank 0 raised the same error and reports it
            log.debug("a call failed on this rank as on rank 0", extra={"call": name}, exc_info=True)
        except Exception:
            log.exception("a call failed on this rank", extra={"call": name})
            _resync(worker.parallel, name)


def _resync(parallel: Parallel, call: str) -> None:
    """After an error that may have struck this rank only: go on if every rank raised too (all
    reach the barrier), else stop this process (and with it the engine)."""
    try:
        dist.barrier(group=parallel.control_group)
    except RuntimeError:
        log.error("the engine's ranks are out of step after an error on some of them; stopping the engine",
                  extra={"call": call, "rank": parallel.rank})
        os._exit(1)
