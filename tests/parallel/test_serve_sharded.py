"""``ember serve --device cpu --nproc 2 --ep 2`` (and ``--tp 2``): the official SDK against an
engine split over two gloo processes (tests/conformance/scenarios/s_sharded.py); then a rank killed with
SIGKILL: rank 0 stops the engine, the supervisor fails its requests and starts all ranks anew, and
the new engine serves the scenario again."""

from __future__ import annotations

import os
import signal
import time

import pytest

from ember.engine.builtin import build_model
from tests.conformance.conftest import run_scenario
from tests.live_server import wait_ready
from tests.parallel.serving import moe_server


@pytest.fixture(scope="module", params=["--ep", "--tp"])
def sharded_server(request, tmp_path_factory):
    """``--nproc 2`` with ``--ep 2`` (experts split) or ``--tp 2`` (heads and MLP width split)."""
    with moe_server(tmp_path_factory.mktemp("sharded"), ["--nproc", "2", request.param, "2"]) as server:
        yield server


def test_sdk_against_a_sharded_engine(sharded_server):
    run_scenario(sharded_server, "s_sharded", timeout_s=400)


def test_ember_status_lists_the_ranks(sharded_server):
    import subprocess
    import sys

    from tests.live_server import REPO

    out = subprocess.run([sys.executable, "-m", "ember.cli", "status", "--database-url", sharded_server.database_url],
                         capture_output=True, text=True, check=True, cwd=REPO).stdout
    pids = _ranks(sharded_server.proc.pid)
    assert "2 processes" in out and all(f"pid={p}" in out for p in pids), (out, pids)


def _children(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of ``pid``'s child processes (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if ppid == pid:
            out.append((int(entry), cmd))
    return out


def _ranks(server_pid: int) -> list[int]:
    """Pids of the engine's processes: rank 0 (a child of the server), then the ranks it started."""
    rank0 = [p for p, cmd in _children(server_pid) if "ember.engine.service" in cmd]
    return rank0 + [p for p, cmd in _children(rank0[0]) if "--rank" in cmd] if rank0 else []


def test_a_dead_rank_restarts_the_whole_engine(sharded_server):
    before = _ranks(sharded_server.proc.pid)
    assert len(before) == 2, before
    os.kill(before[1], signal.SIGKILL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        after = _ranks(sharded_server.proc.pid)
        if len(after) == 2 and not set(after) & set(before):
            break
        time.sleep(0.5)
    else:
        raise AssertionError(f"engine ranks {before} were not replaced: {_ranks(sharded_server.proc.pid)}")
    wait_ready(sharded_server.base_url, sharded_server.proc, sharded_server.log, engines=True)
    run_scenario(sharded_server, "s_sharded", timeout_s=400)


def test_sizes_that_do_not_divide_are_refused_at_start(tmp_path):
    import subprocess
    import sys

    from tests.live_server import REPO

    path = build_model(tmp_path / "m", "qwen3_moe", seed=2)  # 4 experts
    for flags, says in ((["--nproc", "3", "--ep", "2"], "--ep 2 must divide --nproc 3"),
                        (["--nproc", "3", "--ep", "3"], "--ep 3 must divide the 4 experts"),
                        (["--nproc", "4", "--tp", "4"], "--tp 4 must divide the 2 key/value heads"),
                        (["--nproc", "6", "--tp", "2", "--ep", "3"], "--ep 3 must be a multiple of --tp 2")):
        out = subprocess.run([sys.executable, "-m", "ember.cli", "serve", "--home", str(tmp_path / "home"),
                              "--model", f"m={path}", *flags], check=False, capture_output=True, text=True, cwd=REPO, timeout=60)
        assert out.returncode == 2 and says in out.stderr, out.stderr


def test_an_error_on_every_rank_leaves_them_in_step():
    from tests.parallel import resync_cases
    from tests.parallel.launch import run

    run(2, resync_cases.every_rank_fails)


@pytest.mark.parametrize("failing", [0, 1])
def test_an_error_on_one_rank_stops_the_engine_at_once(failing):
    """Not after the collectives' timeout (ten minutes in the engine): the ranks that raised wait
    at most the control group's timeout (3 s here) for the others, then the process exits."""
    from tests.parallel import resync_cases
    from tests.parallel.launch import run

    t0 = time.monotonic()
    with pytest.raises(AssertionError, match=r"ranks exited with \[1, 1\]"):
        run(2, resync_cases.one_rank_fails, failing, timeout=120)
    assert time.monotonic() - t0 < 60


def test_expert_fsdp_is_refused_where_it_cannot_apply(tmp_path):
    import subprocess
    import sys

    from tests.live_server import REPO

    moe, dense = build_model(tmp_path / "moe", "qwen3_moe", seed=2), build_model(tmp_path / "dense", "qwen3", seed=2)
    for path, flags, says in ((moe, ["--nproc", "2", "--ep", "2"], "--expert-fsdp needs --nproc (2) > --ep (2)"),
                              (dense, ["--nproc", "2"], "--expert-fsdp needs MoE layers; 'm' (qwen3) has none")):
        out = subprocess.run([sys.executable, "-m", "ember.cli", "serve", "--home", str(tmp_path / "home"),
                              "--model", f"m={path}", *flags, "--expert-fsdp"],
                             check=False, capture_output=True, text=True, cwd=REPO, timeout=60)
        assert out.returncode == 2 and says in out.stderr, out.stderr
