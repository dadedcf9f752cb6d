"""Stage 7, cancel: with ``sample_cancel_enabled`` in client/dynamic_config, a sample whose caller
abandons it (``future().cancel()``) makes the SDK send POST /api/v1/cancel_future, and the request
ends as "cancelled by the client"; the client and the next sample keep working.

The SDK sends the cancel only for a sample it is already polling for (its submit answered), so the
Qwen3 engine is paused (SIGSTOP) for the scenario's first part: the sample then stays queued for as
long as it takes, with no race against its completion. The engine is paused between transactions
(checked on SQLite, where a paused writer would hold the database's write lock) and resumed in any
case (a watchdog as well)."""

import os
import signal
import sqlite3
import threading
import time

import tinker
from sqlalchemy import select
from sqlalchemy.engine import make_url
from tinker import types

from ember.store import Store
from ember.store.models import EngineRecord, Future
from tests.conformance.scenarios.common import CONF, QWEN3

store = Store.open(CONF["database_url"], pool_size=1, run_migrations=False)


def wait_for(what: str, check, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while not (found := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)
    return found


def write_lock_free() -> bool:
    url = make_url(CONF["database_url"])
    if url.get_backend_name() != "sqlite":
        return True  # PostgreSQL: a paused engine's row locks never cover a new request's rows
    con = sqlite3.connect(url.database, timeout=0.05, isolation_level=None)
    try:
        con.execute("BEGIN IMMEDIATE")
        con.execute("ROLLBACK")
        return True
    except sqlite3.OperationalError:
        return False
    finally:
        con.close()


def pause(pid: int) -> None:
    for _ in range(200):
        os.kill(pid, signal.SIGSTOP)
        if write_lock_free():
            return
        os.kill(pid, signal.SIGCONT)  # caught inside a transaction: let it finish
        time.sleep(0.02)
    raise AssertionError("the engine never paused outside a write transaction")


def sample_rows(sampler_id: str) -> list:
    with store.read() as s:
        return s.execute(select(Future.id, Future.state, Future.error).where(Future.sampler_id == sampler_id)).all()


sc = tinker.ServiceClient()
sampler = sc.create_sampling_client(base_model=QWEN3).result()
assert sampler.holder._client_dynamic_config.sample_cancel_enabled
sampler_id = sampler._sampling_session_id
prompt = types.ModelInput.from_ints([1, 2, 3, 4])
with store.read() as s:
    pid = s.scalar(select(EngineRecord.pid).where(EngineRecord.base_model == QWEN3))

watchdog = threading.Timer(120, os.kill, (pid, signal.SIGCONT))
watchdog.start()
pause(pid)
try:
    fut = sampler.sample(prompt, num_samples=2, sampling_params=types.SamplingParams(max_tokens=8, seed=3))
    (rid, state, _), = wait_for("the queued sample", lambda: sample_rows(sampler_id))
    assert state == "pending", state
    time.sleep(2.0)  # the submit's answer reaches the SDK, which then polls for the (paused) result
    assert fut.future().cancel(), "the sample finished although its engine was paused"
    (_, state, error), = wait_for("the cancel", lambda: [r for r in sample_rows(sampler_id) if r.state != "pending"])
    assert (state, error) == ("failed", "cancelled by the client"), (state, error)
finally:
    os.kill(pid, signal.SIGCONT)
    watchdog.cancel()

out = sampler.sample(prompt, num_samples=1, sampling_params=types.SamplingParams(max_tokens=4, seed=1)).result()
assert len(out.sequences[0].tokens) == 4
sc.close("success").result()
print("stage 7 cancel ok", rid)
