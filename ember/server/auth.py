"""API keys: the ``X-API-Key`` header names the owner of everything a request creates or reads.

Keys are made with ``ember keys create`` and stored hashed. With ``--no-auth`` any key with the
``tml-`` prefix the SDK requires is accepted, and everything belongs to one local owner.
"""

from __future__ import annotations

import time

from fastapi import Request
from fastapi.concurrency import run_in_threadpool

from ember.server.errors import ApiError
from ember.store.repo import KEY_PREFIX, NO_AUTH_OWNER

_CACHE_S = 10.0  # a revoked key stops working within this time


class Authenticator:
    def __init__(self, store, enabled: bool):
        self.store = store
        self.enabled = enabled
        self._cache: dict[str, tuple[str | None, float]] = {}

    def owner(self, key: str | None) -> str:
        """The owner id for ``key``; ``ApiError(401)`` if missing or unknown."""
        known = self.cached(key)
        if known is not None:
            return known
        hit = (self.store.owner_of_key(key), time.monotonic())
        self._cache[key] = hit  # type: ignore[index]
        return self._checked(hit[0])

    def cached(self, key: str | None) -> str | None:
        """The owner if it is known without the database (no auth, or a fresh cache entry); raises
        ``ApiError(401)`` for a missing or malformed key; ``None``: call ``owner``."""
        if not key:
            raise ApiError(401, "missing X-API-Key header")
        if not self.enabled:
            if not key.startswith(KEY_PREFIX):
                raise ApiError(401, f"API keys start with {KEY_PREFIX!r}")
            return NO_AUTH_OWNER
        hit = self._cache.get(key)
        if hit is None or time.monotonic() - hit[1] > _CACHE_S:
            return None
        return self._checked(hit[0])

    @staticmethod
    def _checked(owner: str | None) -> str:
        if owner is None:
            raise ApiError(401, "invalid API key (create one with `ember keys create`)")
        return owner


async def require_owner(request: Request) -> str:
    """FastAPI dependency: the authenticated owner of this request (on the event loop; the
    database is read, in a worker thread, only when the key is not cached)."""
    auth: Authenticator = request.app.state.ember.auth
    key = request.headers.get("x-api-key")
    owner = auth.cached(key)
    if owner is None:
        owner = await run_in_threadpool(auth.owner, key)
    return owner
