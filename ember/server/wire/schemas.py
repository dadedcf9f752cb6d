"""JSON request bodies of the Tinker API (spec §2.1), as the SDK 0.38 sends them.

Unknown fields are ignored (clients send ``type`` literals and fields other servers understand).
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

INT64 = (-(2**63), 2**63 - 1)  # what the store's integer columns and numpy's int64 hold
MAX_DEPTH = 32  # nesting of JSON values (user_metadata, tensors, custom-loss graphs)


def check_wire_value(value: Any, where: str, depth: int = 0) -> None:
    """Refuse, naming ``where``, what no field may carry anywhere in a body: integers outside
    int64, non-finite numbers, strings that are not UTF-8 text (lone surrogates such as
    ``"\ud800"``, which JSON can spell but no database or encoder can store), and nesting deeper
    than ``MAX_DEPTH``. Each request model checks its own fields (and nested values) with it, so
    nothing out of range reaches a route, the store or numpy, and nothing stored breaks a read."""
    if depth > MAX_DEPTH:
        raise _wire_error(f"{where}: nested deeper than {MAX_DEPTH} levels")
    if isinstance(value, bool) or value is None:
        return
    if isinstance(value, int):
        if not INT64[0] <= value <= INT64[1]:
            raise _wire_error(f"{where}: {_short(value)} is outside the 64-bit integer range [{INT64[0]}, {INT64[1]}]")
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise _wire_error(f"{where}: {value} is not a finite number")
    elif isinstance(value, str):
        _check_text(value, where)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_wire_value(item, f"{where}[{i}]", depth + 1)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_text(str(key), f"{where} (a key)")
            check_wire_value(item, f"{where}.{key}", depth + 1)


def text_problem(text: str) -> str | None:
    """Why ``text`` cannot be stored as text (None if it can): a lone surrogate such as
    ``"\ud800"`` (not UTF-8), or a NUL character, which PostgreSQL's text columns refuse."""
    if "\x00" in text:
        return "holds a NUL character (\\u0000), which no text field may carry"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return "not valid UTF-8 text (it holds a lone surrogate such as \\ud800)"
    return None


def _check_text(text: str, where: str) -> None:
    problem = text_problem(text)
    if problem is not None:
        raise _wire_error(f"{where}: {problem}")


def _short(n: int) -> str:
    digits = str(abs(n))
    return str(n) if len(digits) <= 30 else f"{'-' if n < 0 else ''}{digits[:6]}... ({len(digits)} digits)"


def _wire_error(message: str) -> PydanticCustomError:
    return PydanticCustomError("wire_value", "{message}", {"message": message})


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="after")
    def _wire_values(self):
        for name in type(self).model_fields:
            value = getattr(self, name)
            if not isinstance(value, BaseModel):  # a nested body checked its own fields
                check_wire_value(value, name)
        return self


class ClientConfigRequest(_Body):
    sdk_version: str | None = None


class CreateSessionRequest(_Body):
    tags: list[str] = Field(default_factory=list)
    user_metadata: dict[str, Any] | None = None
    sdk_version: str | None = None
    project_id: str | None = None
    display_name: str | None = None


class SessionHeartbeatRequest(_Body):
    session_id: str


class FinishSessionRequest(_Body):
    reason: dict[str, Any] | None = None
    detail: str | None = None


class LoraConfigBody(_Body):
    rank: int = 32
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class CreateModelRequest(_Body):
    session_id: str
    model_seq_id: int = Field(ge=0)
    base_model: str
    user_metadata: dict[str, Any] | None = None
    lora_config: LoraConfigBody = Field(default_factory=LoraConfigBody)
    optimizer_config: dict[str, Any] | None = None


class GetInfoRequest(_Body):
    model_id: str


class AdamParamsBody(_Body):
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0
    type: str | None = None


class OptimStepRequest(_Body):
    model_id: str
    seq_id: int
    adam_params: AdamParamsBody | None = None
    optim_params: dict[str, Any] | None = None
    optimizer_params: dict[str, Any] | None = None


class SaveWeightsRequest(_Body):
    model_id: str
    path: str
    seq_id: int
    ttl_seconds: int | None = None
    overwrite: bool = False
    user_metadata: dict[str, Any] | None = None


class SaveWeightsForSamplerRequest(_Body):
    model_id: str
    seq_id: int
    path: str | None = None
    sampling_session_seq_id: int | None = None
    kind: str = "snapshot"
    ttl_seconds: int | None = None
    user_metadata: dict[str, Any] | None = None


class SaveWeightsExternalRequest(_Body):
    model_id: str
    path: str
    seq_id: int
    ttl_seconds: int | None = None
    age_encryption_recipients: list[str] | None = None


class LoadWeightsRequest(_Body):
    path: str
    optimizer: bool = False
    # create-from-state (ServiceClient): session_id + model_seq_id
    session_id: str | None = None
    model_seq_id: int | None = Field(default=None, ge=0)
    base_model: str | None = None
    user_metadata: dict[str, Any] | None = None
    optimizer_config: dict[str, Any] | None = None
    # legacy in-place load (TrainingClient.load_state): model_id + seq_id
    model_id: str | None = None
    seq_id: int | None = None
    weights_access_token: str | None = None


class CreateSamplingSessionRequest(_Body):
    session_id: str
    sampling_session_seq_id: int = Field(ge=0)
    base_model: str | None = None
    model_path: str | None = None


class RetrieveFutureRequest(_Body):
    request_id: str
    allow_metadata_only: bool = False


class CreateCustomLossRequest(_Body):
    """``POST /api/v1/create_custom_loss`` (flag ``custom_loss_server_side``): a traced per-datum
    loss as plain data (checked by ``ember.lossgraph.validate_program``)."""

    session_id: str
    custom_loss_seq_id: int = Field(ge=0, lt=2**31)
    name: str
    inputs: list[dict[str, Any]]
    graph: dict[str, Any]


class WeightsInfoRequest(_Body):
    tinker_path: str


class CopyWeightsRequest(_Body):
    source_path: str
    session_id: str | None = None
    model_seq_id: int | None = None
    destination_project_id: str | None = None
    ttl_seconds: int | None = None
    weights_access_token: str | None = None


class CheckpointTtlRequest(_Body):
    ttl_seconds: int | None = None


class ModelInputBody(_Body):
    chunks: list[dict[str, Any]]


class SamplingParamsBody(_Body):
    max_tokens: int | None = None
    seed: int | None = None
    stop: str | list[str] | list[int] | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0


class TensorDataBody(_Body):
    """A ``TensorData`` in JSON (``target_prompt_logprobs``): dense ``data`` of ``shape``, or CSR."""

    data: list[int] = Field(default_factory=list)
    dtype: str | None = None
    shape: list[int] | None = Field(default=None, max_length=2)
    sparse_crow_indices: list[int] | None = None
    sparse_col_indices: list[int] | None = None


class SampleRequest(_Body):
    num_samples: int = 1
    prompt: ModelInputBody
    sampling_params: SamplingParamsBody = Field(default_factory=SamplingParamsBody)
    sampling_session_id: str | None = None
    seq_id: int | None = None
    base_model: str | None = None
    model_path: str | None = None
    prompt_logprobs: bool | None = None
    prompt_logprobs_last_n: int | None = None
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    target_prompt_logprobs: TensorDataBody | None = None
    prompt_alt_tokens_k: int = 0
    record_stability_info: bool = False


class SamplingSessionFuturesTarget(_Body):
    """What ``retrieve_futures`` polls: one client (``cloned_sampler_id``, its seq_ids being
    ``1e9 * id + k``) of a sampler. The SDK knows no other target type."""

    type: str = Field(default="sampling_session", pattern="^sampling_session$")
    sampling_session_id: str
    cloned_sampler_id: int = Field(default=0, ge=0, lt=1_000_000_000)


class RetrieveFuturesRequest(_Body):
    """``POST /api/v1/retrieve_futures`` (flag ``sample_use_retrieve_futures``): the completions
    after ``prev_cursor``; ``timeout`` 0 answers at once, null (or positive) long-polls."""

    target: SamplingSessionFuturesTarget
    prev_cursor: int = Field(default=0, ge=0, lt=2**62)
    timeout: float | None = Field(default=None, ge=0)
    retrieved_request_ids: list[str] = Field(default_factory=list)


class JoinSamplingSessionRequest(_Body):
    """``POST /api/v1/join_sampling_session`` (flag ``sample_join_sampling_session``)."""

    sampling_session_id: str


class AssignProjectRequest(_Body):
    """``PUT /api/v1/sessions/{id}/project``."""

    project_id: str = Field(min_length=1, max_length=200)


class SearchOwnerBody(_Body):
    type: Literal["own", "accessible", "user"] = "own"
    owner_urns: list[str] | None = Field(default=None, min_length=1, max_length=10)


class SessionStatusQueryBody(_Body):
    type: Literal["active", "cancelled", "failed", "client_finished"]
    reasons: list[Literal["success", "errored", "interrupted"]] | None = Field(default=None, min_length=1)


class SessionSearchCursorBody(_Body):
    last_created_at: AwareDatetime
    last_session_id: str


class SessionSearchRequest(_Body):
    """``POST /api/v1/sessions/search`` (the SDK's ``SessionSearchRequest``)."""

    session_id: str | None = None
    project_ids: list[str] | None = None
    user_metadata: dict[str, str] = Field(default_factory=dict)
    display_name: str | None = Field(default=None, min_length=1)
    owner: SearchOwnerBody = Field(default_factory=SearchOwnerBody)
    statuses: list[SessionStatusQueryBody] | None = Field(default=None, min_length=1)
    limit: int = Field(default=50, ge=1, le=200)
    cursor: SessionSearchCursorBody | None = None
