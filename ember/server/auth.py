"""API keys: the ``X-API-Key`` header names the owner of everything a request creates or reads.

Keys are made with ``ember keys create`` and stored hashed. With ``--no-auth`` any key with the
``tml-`` prefix the SDK requires is accepted, and everything belongs to one local owner.
"""

from __future__ import annotations

import time

from fastapi import Request

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
        if not key:
            raise ApiError(401, "missing X-API-Key header")
        if not self.enabled:
            if not key.startswith(KEY_PREFIX):
                raise ApiError(401, f"API keys start with {KEY_PREFIX!r}")
            return NO_AUTH_OWNER
        now = time.monotonic()
        hit = self._cache.get(key)
        if hit is None or now - hit[1] > _CACHE_S:
            hit = (self.store.owner_of_key(key), now)
            self._cache[key] = hit
        if hit[0] is None:
            raise ApiError(401, "invalid API key (create one with `ember keys create`)")
        return hit[0]


def require_owner(request: Request) -> str:
    """FastAPI dependency: the authenticated owner of this request."""
    return request.app.state.ember.auth.owner(request.headers.get("x-api-key"))
