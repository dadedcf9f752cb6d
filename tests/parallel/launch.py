"""Run a test body on ``world`` CPU processes joined by a gloo process group (one thread each)."""

from __future__ import annotations

import faulthandler
import os
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, world: int, init: str, fn, args, errors, timeout):
    torch.set_num_threads(1)
    # a rank stuck in a collective prints where it is before the launcher kills it
    faulthandler.dump_traceback_later(max(timeout - 5, 1), exit=False)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    except BaseException:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        raise
    finally:
        dist.destroy_process_group()


def run(world: int, fn, *args, timeout: float = 300) -> None:
    """``fn(rank, world, *args)`` on every rank; a failure on any rank fails the caller with its
    traceback. ``fn`` and ``args`` must be picklable (a module-level function)."""
    ctx = mp.get_context("spawn")
    errors = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{tmp}/store"
        procs = [ctx.Process(target=_entry, args=(r, world, init, fn, args, errors, timeout)) for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(deadline - time.monotonic(), 0))
        alive = [p for p in procs if p.is_alive()]
        for p in alive:
            p.kill()
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    if alive:
        failures.append(f"{len(alive)} rank(s) still running after {timeout} s (a collective that not every rank entered?)")
    bad = [p.exitcode for p in procs if p.exitcode not in (0, None)]
    if failures or bad:
        raise AssertionError("\n".join(failures) or f"ranks exited with {bad}")
