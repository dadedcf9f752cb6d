"""Self-authorising download URLs: ``base64url(JSON claims).HMAC-SHA256``.

A token names one file of one checkpoint folder and an expiry time; anyone holding it may download
that file until then, with no header (tinker-cookbook fetches them with plain ``urllib``)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def sign_token(secret: str, claims: dict, expires_at: float) -> str:
    """A token carrying ``claims`` that verifies until ``expires_at`` (Unix time)."""
    body = _b64(json.dumps({**claims, "exp": int(expires_at)}, separators=(",", ":"), sort_keys=True).encode())
    mac = hmac.new(secret.encode(), body.encode(), hashlib.sha256).digest()
    return f"{body}.{_b64(mac)}"


def verify_token(secret: str, token: str, now: float | None = None) -> dict:
    """The claims of a valid, unexpired token; ``ValueError`` otherwise."""
    try:
        body, mac = token.split(".", 1)
        expected = hmac.new(secret.encode(), body.encode(), hashlib.sha256).digest()
        if not hmac.compare_digest(expected, _unb64(mac)):
            raise ValueError("bad signature")
        claims = json.loads(_unb64(body))
    except (ValueError, json.JSONDecodeError) as e:
        raise ValueError(f"invalid download token: {e}") from None
    if claims.get("exp", 0) < (time.time() if now is None else now):
        raise ValueError("download link expired")
    return claims
