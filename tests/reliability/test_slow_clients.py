"""The short version of the slow-client test (``python -m tests.reliability.slow_clients`` is the
long one): 200 connections trickling headers or bodies do not slow another key's requests."""

from tests.reliability.live import live_server
from tests.reliability.slow_clients import slow_clients


def test_slow_clients_do_not_starve_others(tmp_path):
    with live_server(tmp_path) as live:
        r = slow_clients(live, connections=200, seconds=6)
    assert r["slow_connections"] == 200, r
    assert r["failures"] == 0 and r["requests"] > 20 and r["p99_ms"] < 1000, r
