"""HTTP errors with a JSON ``detail`` the SDK and users can act on.

Status rules (spec §1.4, §9): 400 for bad input (always with a body: an empty 400 is retried as a
proxy glitch), 404 for unknown or foreign ids, 410 for ended sessions and models, 413 for oversized
bodies, 501 for what this server does not implement. Never 409 for a permanent conflict (the SDK
retries 409 for minutes).
"""

from __future__ import annotations

from fastapi import HTTPException


class ApiError(HTTPException):
    def __init__(self, status_code: int, detail: str, headers: dict[str, str] | None = None):
        # The SDK retries 5xx unless told not to; a 501 is final.
        if status_code == 501:
            headers = {**(headers or {}), "x-should-retry": "false"}
        super().__init__(status_code=status_code, detail=detail, headers=headers)


def bad_request(detail: str) -> ApiError:
    return ApiError(400, detail)


def not_found(what: str) -> ApiError:
    return ApiError(404, f"{what} not found")


def gone(detail: str) -> ApiError:
    return ApiError(410, detail)


def not_implemented(detail: str) -> ApiError:
    return ApiError(501, detail)
