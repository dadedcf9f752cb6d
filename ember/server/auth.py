"""API keys and the JWTs exchanged for them: the ``X-API-Key`` header names the owner of everything
a request creates or reads.

Keys are made with ``ember keys create`` and stored hashed. With ``--no-auth`` any key with the
``tml-`` prefix the SDK requires is accepted, and everything belongs to one local owner.

With the client flag ``pjwt_auth_enabled`` the SDK exchanges its key at ``POST /auth/token`` for a
short-lived JWT (HS256 under a secret every API process reads from the store; claims ``sub`` = the
key's owner id, ``org_id``, ``email``, ``iat``, ``exp``) and sends that instead, refreshing it at
about half its lifetime. A JWT that is expired, forged or malformed gets 401 with
``WWW-Authenticate: Bearer error="invalid_token"`` (the SDK then fetches a new one); one whose key
was revoked stops working within the cache time, as the key does.
"""

from __future__ import annotations

import hashlib
import time

import jwt
from fastapi import Request
from fastapi.concurrency import run_in_threadpool

from ember.server.errors import ApiError
from ember.store.repo import KEY_PREFIX, NO_AUTH_OWNER

_CACHE_S = 10.0  # a revoked key stops working within this time
_CACHE_MAX = 65536
JWT_ISSUER = "ember"
JWT_ORG = "ember"  # one organisation per server: RestClient.whoami() reports tml:organization:ember
JWT_SECRET_SETTING = "jwt_signing_secret"
_INVALID_TOKEN = {"WWW-Authenticate": 'Bearer error="invalid_token"'}


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def is_jwt(key: str) -> bool:
    return not key.startswith(KEY_PREFIX) and key.count(".") == 2


class Authenticator:
    def __init__(self, store, enabled: bool, jwt_secret: str, jwt_ttl_s: float = 3600.0):
        self.store = store
        self.enabled = enabled
        self.jwt_secret = jwt_secret
        self.jwt_ttl_s = jwt_ttl_s
        # SHA-256 of a key -> (owner, read at): keys are never held or compared in the clear (the
        # store, too, looks a key up by its hash), so lookups leak nothing about a key's bytes
        self._cache: dict[bytes, tuple[str | None, float]] = {}
        self._live: dict[str, float] = {}  # owner id of a JWT -> when its key was last seen unrevoked

    def owner(self, key: str | None) -> str:
        """The owner id for ``key`` (an API key or a JWT); ``ApiError(401)`` if missing, unknown,
        revoked or invalid."""
        if key and is_jwt(key):
            owner = self._jwt_owner(key)  # verified once; its key's liveness may be cached
            if not self.enabled or self._seen_live(owner):
                return owner
            if not self.store.key_active(owner):
                raise ApiError(401, "the API key this token was issued for has been revoked")
            self._live[owner] = time.monotonic()
            return owner
        known = self.cached(key)
        if known is not None:
            return known
        hit = (self.store.owner_of_key(key), time.monotonic())
        if len(self._cache) >= _CACHE_MAX:  # random keys must not grow it without bound
            self._cache.clear()
        self._cache[_digest(key)] = hit  # type: ignore[arg-type]
        return self._checked(hit[0])

    def cached(self, key: str | None) -> str | None:
        """The owner if it is known without the database (no auth, or a fresh cache entry); raises
        ``ApiError(401)`` for a missing, malformed or invalid key; ``None``: call ``owner``."""
        if not key:
            raise ApiError(401, "missing X-API-Key header")
        if is_jwt(key):
            owner = self._jwt_owner(key)
            return owner if not self.enabled or self._seen_live(owner) else None
        if not self.enabled:
            if not key.startswith(KEY_PREFIX):
                raise ApiError(401, f"API keys start with {KEY_PREFIX!r}")
            return NO_AUTH_OWNER
        hit = self._cache.get(_digest(key))
        if hit is None or time.monotonic() - hit[1] > _CACHE_S:
            return None
        return self._checked(hit[0])

    def _seen_live(self, owner: str) -> bool:
        seen = self._live.get(owner)
        return seen is not None and time.monotonic() - seen <= _CACHE_S

    def forget(self, key: str) -> None:
        """Drop ``key`` from the cache (it was just revoked here)."""
        owner = self._cache.pop(_digest(key), (None, 0.0))[0]
        if owner is not None:
            self._live.pop(owner, None)

    def issue_jwt(self, owner: str) -> str:
        """A JWT for ``owner`` that expires after ``jwt_ttl_s``."""
        now = int(time.time())
        claims = {"iss": JWT_ISSUER, "sub": owner, "org_id": JWT_ORG, "email": "", "iat": now,
                  "exp": now + int(self.jwt_ttl_s)}
        return jwt.encode(claims, self.jwt_secret, algorithm="HS256")

    def _jwt_owner(self, token: str) -> str:
        try:
            claims = jwt.decode(token, self.jwt_secret, algorithms=["HS256"], issuer=JWT_ISSUER,
                                options={"require": ["exp", "iat", "sub"]})
        except jwt.InvalidTokenError as e:
            raise ApiError(401, f"invalid token: {e}", headers=_INVALID_TOKEN) from None
        owner = str(claims["sub"])
        if not self.enabled and owner != NO_AUTH_OWNER:
            raise ApiError(401, "invalid token: not issued by this --no-auth server", headers=_INVALID_TOKEN)
        return owner

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
