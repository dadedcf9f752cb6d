"""The OpenAI-compatible wire: request bodies of ``/oai/api/v1/completions`` and
``/oai/api/v1/chat/completions`` (the parameters Ember serves; others are refused, not ignored),
OpenAI's error shape, and the response and stream-chunk builders. No torch here."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import Field, model_validator

from ember.server.wire.schemas import _Body

MAX_LOGPROBS = 20  # top logprobs per token (OpenAI's own cap)
MAX_N = 128
MAX_PROMPTS = 64  # prompts in one /completions request (each becomes a sampling request)


class OpenAIError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind or {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
                             429: "rate_limit_error"}.get(status, "api_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


# Parameters of OpenAI's API that Ember does not implement: a request that sets one to anything but
# its neutral value is refused (silently ignoring it would answer something else than was asked).
_UNSUPPORTED = {"frequency_penalty": 0, "presence_penalty": 0, "logit_bias": None, "best_of": 1, "echo": False,
                "suffix": None, "tools": None, "tool_choice": None, "functions": None, "function_call": None,
                "response_format": None, "parallel_tool_calls": None, "audio": None, "modalities": None,
                "prediction": None}


class _Params(_Body):
    model: str = Field(min_length=1, max_length=400)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    user: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key, neutral in _UNSUPPORTED.items():
                if data.get(key, neutral) not in (neutral, None):
                    raise ValueError(f"{key} is not supported by this server")
        return data

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop takes up to 4 non-empty strings")
        return stops


class CompletionRequest(_Params):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for completions


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise ValueError(f"message content of type {part.get('type')!r} is not supported; send text")
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class ChatCompletionRequest(_Params):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


def completion_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def envelope(kind: str, cid: str, model: str, choices: list[dict], **extra) -> dict:
    """A completion (``text_completion`` / ``chat.completion``) or a stream chunk."""
    return {"id": cid, "object": kind, "created": int(time.time()), "model": model, "choices": choices,
            "system_fingerprint": "ember", **extra}
