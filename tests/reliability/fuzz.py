"""Fuzzing a live ``ember serve``: figures of 5xx answers and engine crashes (issue 19, part 1).

Three sources of requests, all over real HTTP:

* **schemathesis** over Ember's own OpenAPI document: every operation (the hot routes that bypass
  FastAPI's router too), positive (schema-valid) and negative (schema-violating) cases;
* **mutated SDK bodies** (``tests/reliability/bodies.py``): a well-formed body of each route with
  one value anywhere replaced by a hostile one (integers outside int64, lone surrogates, NaN, deep
  nesting, wrong types), and SDK-encoded protobuf ``forward_backward`` bodies with bytes overwritten,
  inserted or cut;
* **fixed malformed inputs**: oversized and truncated JSON, wrong content types, corrupt zstd,
  deeply nested JSON, garbage bytes, unknown ids.

Each runs with key ``alice`` on a server with authentication and on one with ``--no-auth``. Every
few requests another key (``bob``) makes a well-formed request, which must succeed; at the end the
engine must not have died or restarted.

    python -m tests.reliability.fuzz --examples 200 --out fuzz.json      # the long version
    python -m tests.reliability.fuzz --examples 10                        # about what CI runs
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

import httpx
import schemathesis
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from tests.reliability.bodies import HOSTILE, corrupted, mutated, paths, templates
from tests.reliability.live import MODEL, Live, live_server

PROBE_EVERY = 25  # requests between two well-formed requests of another key
# revokes the key it is called with (``tinker auth logout``): it would end the run (tested in test_jwt)
SKIPPED = {("DELETE", "/api/v1/auth/apikey/me")}


class Tally:
    """Statuses per route, 5xx answers with their request, and the other key's probes."""

    def __init__(self, live: Live):
        self.live = live
        self.by_route: dict[str, Counter] = defaultdict(Counter)
        self.server_errors: list[dict] = []
        self.probes = Counter()
        self.count = 0

    def record(self, route: str, status: int, request: str, detail: str = "") -> None:
        self.by_route[route][status] += 1
        if status >= 500:
            self.server_errors.append({"route": route, "status": status, "request": request[:500], "detail": detail[:500]})
        self.count += 1
        if self.count % PROBE_EVERY == 0:
            self.probes["ok" if self.live.other_key_works() else "failed"] += 1

    def summary(self) -> dict:
        return {
            "requests": self.count,
            "server_errors": len(self.server_errors),
            "routes": {r: {"tried": sum(c.values()), "5xx": sum(n for s, n in c.items() if s >= 500),
                           "statuses": dict(sorted(c.items()))} for r, c in sorted(self.by_route.items())},
            "other_key_probes": dict(self.probes),
            "examples_of_5xx": self.server_errors[:10],
        }


def setup_ids(live: Live) -> tuple[str, str, str]:
    """A session, a trained-on model and a sampler of ``alice`` (for the bodies that need ids)."""
    with live.http() as c:
        session = c.post("/api/v1/create_session", json={"tags": [], "user_metadata": {}}).json()["session_id"]
        r = c.post("/api/v1/create_model", json={"session_id": session, "model_seq_id": 0, "base_model": MODEL,
                                                 "lora_config": {"rank": 4, "seed": 0}}).json()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            f = c.post("/api/v1/retrieve_future", json={"request_id": r["request_id"]}).json()
            if f.get("type") != "try_again":
                break
        sampler = c.post("/api/v1/create_sampling_session", json={"session_id": session, "sampling_session_seq_id": 0,
                                                                   "base_model": MODEL}).json()["sampling_session_id"]
    return session, r["model_id"], sampler


def run_schemathesis(live: Live, tally: Tally, examples: int) -> dict:
    """Every operation of the OpenAPI document, positive and negative cases."""
    schema = schemathesis.openapi.from_dict(httpx.get(f"{live.base_url}/openapi.json").json())
    headers = {"X-API-Key": live.keys["alice"]}
    errors = []
    for result in schema.get_all_operations():
        op = result.ok()
        if (op.method.upper(), op.path) in SKIPPED:
            continue
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            try:
                _cases(op, mode, examples, live, tally, headers)()
            except Exception as e:  # noqa: BLE001 - an unsatisfiable schema is reported, not fatal
                errors.append(f"{op.method.upper()} {op.path} {mode.value}: {type(e).__name__}: {str(e)[:200]}")
    return {"generation_errors": errors}


def _cases(op, mode, examples: int, live: Live, tally: Tally, headers: dict):
    """The hypothesis test that calls ``op`` with ``examples`` cases of ``mode``."""
    route = f"{op.method.upper()} {op.path}"

    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=op.as_strategy(generation_mode=mode))
    def call(case):
        response = case.call(base_url=live.base_url, headers=headers, timeout=30)
        tally.record(route, response.status_code, case.as_curl_command(), response.text)

    return call


def run_mutations(live: Live, tally: Tally, examples: int, ids: tuple[str, str, str]) -> None:
    """Well-formed bodies with one hostile value each, and corrupted protobuf bodies."""
    from tinker import types
    from tinker.proto.request_conv import forward_backward_request_to_proto

    session, model, sampler = ids
    bodies = templates(session, model, sampler)
    client = live.http()

    @settings(max_examples=examples * len(bodies), deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def json_case(data):
        method, path, body = data.draw(st.sampled_from(bodies))
        body = mutated(body, data.draw(st.sampled_from(list(paths(body)))), data.draw(HOSTILE))
        text = json.dumps(body)
        r = client.request(method, path, content=text, headers={"Content-Type": "application/json"})
        tally.record(f"{method} {path.replace(session, '{session_id}')}", r.status_code, text, r.text)

    datum = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                        loss_fn_inputs={"target_tokens": [2, 3, 4], "advantages": [0.0, 1.0, 1.0]})

    @settings(max_examples=examples * 4, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def proto_case(data):
        d = datum.with_provenance(model_input=[types.PromptProvenanceSpan(sequence_id="r:0", length=3)],
                                  loss_fn_inputs=[types.SampledProvenanceSpan(sequence_id="r:0", length=3)])
        loss = data.draw(st.sampled_from(["cross_entropy", "stable_reinforce", "ppo"]))
        req = types.ForwardBackwardRequest(forward_backward_input=types.ForwardBackwardInput(
            data=[d if data.draw(st.booleans()) else datum], loss_fn=loss), model_id=model, seq_id=data.draw(st.integers(1, 9)))
        body = corrupted(forward_backward_request_to_proto(req).SerializeToString(), data)
        compress = data.draw(st.booleans())
        payload = zstandard.ZstdCompressor().compress(body) if compress else body
        headers = {"Content-Type": "application/x-protobuf", **({"Content-Encoding": "zstd"} if compress else {})}
        r = client.post("/api/v1/forward_backward", content=payload, headers=headers)
        tally.record("POST /api/v1/forward_backward", r.status_code, body.hex()[:400], r.text)

    try:
        json_case()
        proto_case()
    finally:
        client.close()


def run_fixed(live: Live, tally: Tally, seed: int) -> None:
    """Malformed inputs no generator aims at on purpose."""
    rng = random.Random(seed)
    c = live.http()
    huge = b'{"tags": ["' + b"x" * (70 << 20) + b'"]}'
    cases = [
        ("POST", "/api/v1/create_session", b'{"tags": [', "application/json", {}),
        ("POST", "/api/v1/optim_step", b'{"model_id": "a", "seq_id"', "application/json", {}),
        ("POST", "/api/v1/create_session", huge, "application/json", {}),
        ("POST", "/api/v1/optim_step", huge, "application/json", {}),
        ("POST", "/api/v1/create_session", b"[" * 100_000 + b"]" * 100_000, "application/json", {}),
        ("POST", "/api/v1/asample", b'{"prompt": ' + b'{"a":' * 5000 + b"1" + b"}" * 5000 + b"}", "application/json", {}),
        ("POST", "/api/v1/create_session", b'{"tags": []}', "text/plain", {}),
        ("POST", "/api/v1/create_session", b"tags=1", "application/x-www-form-urlencoded", {}),
        ("POST", "/api/v1/forward_backward", b'{"model_id": "x"}', "application/json", {}),
        ("POST", "/api/v1/forward_backward", b"\x28\xb5\x2f\xfd garbage", "application/x-protobuf",
         {"Content-Encoding": "zstd"}),
        ("POST", "/api/v1/forward_backward", b"", "application/x-protobuf", {"Content-Encoding": "br"}),
        ("POST", "/api/v1/forward_backward", zstandard.ZstdCompressor().compress(b"\0" * (80 << 20)),
         "application/x-protobuf", {"Content-Encoding": "zstd"}),
        ("POST", "/api/v1/retrieve_future", b'{"request_id": "no-such-request"}', "application/json", {}),
        ("GET", "/api/v1/training_runs/no:train:0", b"", "application/json", {}),
        ("GET", "/api/v1/download/not-a-token", b"", "application/json", {}),
        ("POST", "/api/v1/sessions/../../etc/finish", b"{}", "application/json", {}),
    ]
    cases += [("POST", rng.choice(["/api/v1/create_model", "/api/v1/asample", "/api/v1/save_weights"]),
               rng.randbytes(rng.randint(1, 200)), "application/json", {}) for _ in range(20)]
    for method, path, body, ctype, headers in cases:
        try:
            r = c.request(method, path, content=body, headers={"Content-Type": ctype, **headers})
            tally.record(f"{method} {path}", r.status_code, body[:200].decode(errors="replace"), r.text)
        except httpx.HTTPError as e:  # the server closing an oversized upload is an answer too
            tally.record(f"{method} {path}", 413 if len(body) > 1 << 20 else 599, body[:200].decode(errors="replace"),
                         str(e))
    c.close()


def fuzz(root: Path, examples: int = 10, seed: int = 0) -> dict:
    """Fuzz a server with and one without authentication; the report of both."""
    report = {}
    for auth in (True, False):
        with live_server(root / ("auth" if auth else "noauth"), auth=auth) as live:
            pid = live.engine_pid()
            tally = Tally(live)
            t0 = time.monotonic()
            ids = setup_ids(live)
            extra = run_schemathesis(live, tally, examples)
            run_mutations(live, tally, examples, ids)
            run_fixed(live, tally, seed)
            after = live.other_key_works()
            report["auth" if auth else "no_auth"] = {
                **tally.summary(), **extra, "seconds": round(time.monotonic() - t0, 1),
                "engine_crashes": live.engine_deaths(), "engine_restarts": live.engine_starts() - 1,
                "engine_pid_unchanged": live.engine_pid() == pid, "other_key_after": after,
            }
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=50, help="examples per operation and generation mode")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="write the report as JSON")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ember-fuzz-") as tmp:
        report = fuzz(Path(tmp), args.examples, args.seed)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    for name, r in report.items():
        print(f"{name}: {r['requests']} requests over {len(r['routes'])} routes in {r['seconds']} s; "
              f"5xx {r['server_errors']}; engine crashes {r['engine_crashes']}, restarts {r['engine_restarts']}; "
              f"other key: {r['other_key_probes']} during, {'ok' if r['other_key_after'] else 'FAILED'} after")
        for route, x in r["routes"].items():
            print(f"  {route}: {x['tried']} tried, {x['5xx']} 5xx {x['statuses']}")
    bad = any(r["server_errors"] or r["engine_crashes"] or r["engine_restarts"] or not r["other_key_after"]
              or r["other_key_probes"].get("failed") for r in report.values())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
