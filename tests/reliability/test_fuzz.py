"""The short version of the API fuzzer (``python -m tests.reliability.fuzz`` is the long one):
schemathesis over the OpenAPI document, mutated SDK bodies and fixed malformed inputs against a
live ``ember serve`` with and without authentication. No 5xx, no engine crash, and another key's
well-formed requests succeed during and after."""

from tests.reliability.fuzz import fuzz


def test_fuzzing_the_api_finds_no_5xx_and_no_engine_crash(tmp_path):
    report = fuzz(tmp_path, examples=5)
    for name, r in report.items():
        assert r["requests"] > 300 and len(r["routes"]) >= 40, (name, r["requests"], sorted(r["routes"]))
        assert r["server_errors"] == 0, (name, r["examples_of_5xx"])
        assert r["engine_crashes"] == 0 and r["engine_restarts"] == 0 and r["engine_pid_unchanged"], name
        assert r["other_key_probes"].get("failed", 0) == 0 and r["other_key_probes"]["ok"] > 5, name
        assert r["other_key_after"], name
