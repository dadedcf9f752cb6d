"""Prometheus ``GET /metrics``: HTTP traffic of this API process, plus queue depth, futures by state
and the engines' work counters (passes, tokens, busy seconds) read from the store at scrape time."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

REGISTRY = CollectorRegistry()
_REQUESTS = Counter("ember_http_requests", "HTTP requests", ["method", "route", "status"], registry=REGISTRY)
_LATENCY = Histogram(
    "ember_http_request_seconds",
    "HTTP request latency (retrieve_future includes its long-poll wait)",
    ["route"],
    registry=REGISTRY,
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)

router = APIRouter()


def observe_request(method: str, route: str, status: int, seconds: float) -> None:
    _REQUESTS.labels(method, route, str(status)).inc()
    _LATENCY.labels(route).observe(seconds)


def _store_families(store) -> list:
    states = GaugeMetricFamily("ember_futures", "Futures by base model and state", labels=["base_model", "state"])
    depth = GaugeMetricFamily("ember_queue_depth", "Pending futures per base model", labels=["base_model"])
    pending: dict[str, int] = {}
    for (base, state), n in store.queue_counts().items():
        states.add_metric([base, state], n)
        if state == "pending":
            pending[base] = pending.get(base, 0) + n
    up = GaugeMetricFamily("ember_engine_up", "1 when the engine process is ready", labels=["base_model"])
    passes = CounterMetricFamily("ember_engine_passes", "Packed forward/backward passes", labels=["base_model"])
    tokens = CounterMetricFamily("ember_engine_tokens", "Tokens in forward/backward passes", labels=["base_model"])
    busy = CounterMetricFamily("ember_engine_busy_seconds", "Seconds spent in passes", labels=["base_model"])
    last = GaugeMetricFamily("ember_engine_last_pass_seconds", "Duration of the latest pass", labels=["base_model"])
    tps = GaugeMetricFamily("ember_engine_tokens_per_second", "Tokens per busy second (lifetime)", labels=["base_model"])
    restarts = GaugeMetricFamily("ember_engine_generation", "Engine starts so far", labels=["base_model"])
    for e in store.engines():
        depth.add_metric([e.base_model], pending.pop(e.base_model, 0))
        up.add_metric([e.base_model], 1.0 if e.status == "ready" else 0.0)
        passes.add_metric([e.base_model], e.passes)
        tokens.add_metric([e.base_model], e.tokens)
        busy.add_metric([e.base_model], e.busy_seconds)
        last.add_metric([e.base_model], e.last_pass_seconds)
        tps.add_metric([e.base_model], e.tokens / e.busy_seconds if e.busy_seconds else 0.0)
        restarts.add_metric([e.base_model], e.generation)
    for base, n in pending.items():
        depth.add_metric([base], n)
    return [states, depth, up, passes, tokens, busy, last, tps, restarts]


@router.get("/metrics", include_in_schema=False)
async def prometheus_metrics(request: Request) -> Response:
    store = request.app.state.ember.store
    families = await run_in_threadpool(_store_families, store)
    text = generate_latest(REGISTRY).decode()
    extra = CollectorRegistry()

    class _Snapshot:
        def collect(self):
            return families

    extra.register(_Snapshot())
    return Response(text + generate_latest(extra).decode(), media_type="text/plain; version=0.0.4")
