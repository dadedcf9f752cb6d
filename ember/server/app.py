"""The FastAPI application of ``ember serve``: Tinker's HTTP API over Ember's store.

Routes validate requests, write them to the store as futures and answer results; engine processes
do the work. Nothing here imports torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ember import doorbell
from ember.server import metrics
from ember.server.auth import JWT_SECRET_SETTING, Authenticator, require_owner
from ember.server.config import ServerConfig
from ember.server.quotas import QuotaGuard
from ember.server.waiter import FutureWaiter
from ember.storage import Storage
from ember.store import Store
from ember.store.models import TrainingModel

log = logging.getLogger("ember.server")


@dataclass
class EmberState:
    """What every route needs, at ``request.app.state.ember``."""

    config: ServerConfig
    store: Store
    storage: Storage
    auth: Authenticator
    waiter: FutureWaiter
    secret: str
    quota: QuotaGuard
    _doorbells: tuple[float, dict[str, int | None]] = (0.0, {})
    # models seen live, by id (see ``routes.common.hot_model``)
    models: dict[str, TrainingModel] = field(default_factory=dict)
    # custom losses read from the store (immutable): loss_id -> (owner, program)
    custom_losses: dict[str, tuple[str, dict]] = field(default_factory=dict)
    # requests this process just queued: id -> (owner, reply, monotonic time) (see ``remember``)
    submitted: dict[str, tuple[str, dict, float]] = field(default_factory=dict)

    def remember(self, request_id: str, owner: str, reply: dict) -> None:
        """Note a request queued by a hot route, so that its ``retrieve_future`` needs no store read
        while it is pending, nor after an engine's datagram brought its outcome (``recent_s``)."""
        if len(self.submitted) >= 8192:  # oldest first (insertion order)
            for rid in list(self.submitted)[:1024]:
                self.submitted.pop(rid, None)
        self.submitted[request_id] = (owner, reply, time.monotonic())

    def recent_submit(self, request_id: str, owner: str, recent_s: float = 60.0) -> dict | None:
        """The reply of ``owner``'s request queued here less than ``recent_s`` ago, else None."""
        hit = self.submitted.get(request_id)
        if hit is None or hit[0] != owner or time.monotonic() - hit[2] > recent_s:
            return None
        return hit[1]

    def ring(self, base_model: str) -> None:
        """Wake the engine of ``base_model`` if it runs on this host (``ember.doorbell``)."""
        checked, ports = self._doorbells
        if time.monotonic() - checked > 2.0 or base_model not in ports:
            ports = {e.base_model: e.doorbell_port for e in self.store.engines()}
            self._doorbells = (time.monotonic(), ports)
        doorbell.ring(ports.get(base_model))


class BodyLimit:
    """ASGI middleware: bodies over ``limit`` bytes get 413 with a JSON detail (declared or streamed).
    Paths in ``own_limit`` enforce the limit themselves (forward_backward: to record the rejection
    of the request the body names)."""

    def __init__(self, app, limit: int, own_limit: tuple[str, ...] = ()):
        self.app = app
        self.limit = limit
        self.own_limit = own_limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") in self.own_limit:
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await _send_json(send, 413, f"request body of {int(declared)} bytes exceeds the limit of {self.limit}")
        seen = 0
        too_big = False

        async def limited_receive():
            nonlocal seen, too_big
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    too_big = True
                    raise _TooLarge()
            return message

        started = False

        async def tracking_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _TooLarge:
            if not started:
                await _send_json(send, 413, f"request body exceeds the limit of {self.limit} bytes")


class TextOnly:
    """ASGI middleware: a path or query string that holds a NUL character (``%00``) is a 400: no
    route takes one, and the store could not look it up (PostgreSQL's text refuses NUL)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        query = scope.get("query_string", b"") if scope["type"] == "http" else b""
        if scope["type"] == "http" and ("\x00" in scope.get("path", "") or b"%00" in query or b"\x00" in query):
            return await _send_json(send, 400, "the URL holds a NUL character (%00), which no path or parameter may carry")
        return await self.app(scope, receive, send)


class AccessLog:
    """ASGI middleware: one structured log line and the Prometheus counters per request."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        status = 500

        async def send_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            seconds = time.perf_counter() - t0
            route = scope.get("route")
            metrics.observe_request(scope["method"], getattr(route, "path", "unmatched"), status, seconds)
            sdk_method = next((v.decode() for k, v in scope.get("headers", ()) if k == b"x-sdk-method"), None)
            log.info("request", extra={"method": scope["method"], "path": scope["path"], "status": status,
                                       "ms": round(seconds * 1000, 2), "sdk_method": sdk_method})


class HotRoutes:
    """ASGI middleware: the endpoints every training step or sample calls (``POST``
    forward_backward, optim_step, asample, retrieve_future) go straight to their route functions, past FastAPI's routing,
    dependency solving and response encoding, which cost as much as the routes' own work. The
    same functions, auth (``require_owner``) and JSON errors as through FastAPI; everything else,
    and every other method on these paths, goes to the app.

    ``routes``: path -> ``async (request, owner) -> dict | Response``; a route that takes a JSON
    body parses it itself (``json_body``)."""

    def __init__(self, app, api: FastAPI, routes: dict):
        self.app = app
        self.api = api
        self.routes = routes
        # the FastAPI route of each path, for the access log's and the metrics' route label
        self.labels = {r.path: r for r in api.routes if getattr(r, "path", None) in routes}

    async def __call__(self, scope, receive, send):
        route = self.routes.get(scope.get("path")) if scope["type"] == "http" and scope["method"] == "POST" else None
        if route is None:
            return await self.app(scope, receive, send)
        scope["app"], scope["route"] = self.api, self.labels.get(scope["path"])
        request = Request(scope, receive)
        try:
            answer = await route(request, await require_owner(request))
        except StarletteHTTPException as e:
            answer = JSONResponse({"detail": e.detail or "error"}, status_code=e.status_code, headers=e.headers)
        except ValidationError as e:
            answer = JSONResponse({"detail": _validation_detail(e.errors())}, status_code=400)
        except _TooLarge:
            raise  # BodyLimit answers 413
        except Exception as e:  # the same 500 as the app's handler
            log.exception("unhandled error", extra={"path": scope["path"]})
            answer = JSONResponse({"detail": f"internal server error: {type(e).__name__}: {e}"}, status_code=500)
        if isinstance(answer, dict):
            answer = JSONResponse(answer)
        await answer(scope, receive, send)


async def json_body(request: Request, schema):
    """The request's JSON body validated as ``schema`` (a ``ValidationError`` is a 400)."""
    return schema.model_validate_json(await request.body())


class _TooLarge(Exception):
    pass


async def _send_json(send, status: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


def _validation_detail(errors) -> str:
    parts = []
    for err in errors:
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        if err.get("type") == "wire_value":  # its message starts with the field's path below ``loc``
            parts.append(f"{loc}.{err.get('msg')}" if loc else err.get("msg"))
        else:
            parts.append(f"{loc or 'body'}: {err.get('msg')}")
    return "invalid request: " + "; ".join(parts)


async def _reaper(state: EmberState) -> None:
    """Ends idle sessions, deletes expired checkpoints and old futures."""
    cfg = state.config
    while True:
        try:
            expired = await asyncio.to_thread(state.store.expire_idle_sessions, cfg.session_timeout_s)
            for sid in expired:
                log.info("session expired", extra={"session_id": sid})
            for ckpt in await asyncio.to_thread(state.store.expired_checkpoints):
                if await asyncio.to_thread(state.store.delete_checkpoint, ckpt.tinker_path, None):
                    if not await asyncio.to_thread(state.store.uri_referenced, ckpt.uri):  # copies share files
                        await asyncio.to_thread(state.storage.delete, ckpt.uri)
                    log.info("checkpoint expired", extra={"tinker_path": ckpt.tinker_path})
            await asyncio.to_thread(state.store.purge_futures, cfg.future_retention_s)
            await state.waiter.refresh()
        except Exception:
            log.exception("reaper pass failed")
        await asyncio.sleep(cfg.reaper_interval_s)


def hot_routes() -> dict:
    """The routes ``HotRoutes`` serves, by path."""
    from ember.server.routes import futures, sampling, training
    from ember.server.wire import schemas

    async def optim_step(request: Request, owner: str):
        return await training.optim_step(await json_body(request, schemas.OptimStepRequest), request, owner)

    async def asample(request: Request, owner: str):
        return await sampling.asample(await json_body(request, schemas.SampleRequest), request, owner)

    async def retrieve_future(request: Request, owner: str):
        return await futures.retrieve_future(await json_body(request, schemas.RetrieveFutureRequest), request, owner)

    return {"/api/v1/forward_backward": training.forward_backward, "/api/v1/optim_step": optim_step,
            "/api/v1/asample": asample, "/api/v1/retrieve_future": retrieve_future}


def create_app(config: ServerConfig, store: Store | None = None) -> FastAPI:
    """The API application for ``config`` (the store is opened and migrated unless given)."""
    from ember.server.routes import console, futures, openai, rest, sampling, service, training

    store = store or Store.open(config.database_url)
    state = EmberState(
        config=config,
        store=store,
        storage=Storage(config.storage),
        auth=Authenticator(store, config.auth, store.setting(JWT_SECRET_SETTING, lambda: secrets.token_hex(32)),
                           config.jwt_ttl_s),
        waiter=FutureWaiter(store),
        secret=store.setting("url_signing_secret", lambda: secrets.token_hex(32)),
        quota=QuotaGuard(store, config.quotas),
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await state.waiter.start()
        task = asyncio.create_task(_reaper(state))
        yield
        task.cancel()
        await state.waiter.stop()

    app = FastAPI(title="Ember (Tinker-compatible API)", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.ember = state

    @app.exception_handler(RequestValidationError)
    async def _on_validation(_request: Request, exc: RequestValidationError):
        return JSONResponse({"detail": _validation_detail(exc.errors())}, status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(_request: Request, exc: StarletteHTTPException):
        detail = exc.detail if exc.detail else "error"
        return JSONResponse({"detail": detail}, status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _on_error(request: Request, exc: Exception):
        log.exception("unhandled error", extra={"path": request.url.path})
        return JSONResponse({"detail": f"internal server error: {type(exc).__name__}: {exc}"}, status_code=500)

    for module in (futures, training, sampling, service, rest):  # the hot routes are matched first
        app.include_router(module.router)
    app.include_router(openai.router)
    app.include_router(console.router)
    app.include_router(metrics.router)
    app.add_middleware(HotRoutes, api=app, routes=hot_routes())
    app.add_middleware(AccessLog)
    app.add_middleware(BodyLimit, limit=config.max_body_bytes, own_limit=("/api/v1/forward_backward",))
    app.add_middleware(TextOnly)
    return app
