"""The short version of the load test (``python -m tests.reliability.load --clients 64 --seconds 600``
is the long one): 8 SDK clients mixing training, sampling, snapshots and checkpoints for 20 s on
the test backend (SQLite, or PostgreSQL in CI's second phase)."""

from tests.reliability.load import run_load


def test_sustained_load_loses_nothing(tmp_path):
    r = run_load(tmp_path, clients=8, seconds=20)
    assert r["database_is_locked"] == 0 and not r["client_errors"], r["client_errors"]
    assert not r["requests_open_at_end"] and not r["optim_steps_mismatched"], r
    assert r["client_ops"]["train"]["n"] > 50 and r["futures_per_s"] > 10, r["client_ops"]
    assert r["engine_restarts"] == 0
    growth = r["memory_end"]["api_mb"] - r["memory_start"]["api_mb"]
    assert growth < 100, (r["memory_start"], r["memory_end"])
