"""Sampling wire codec: Tinker's JSON ``SampleRequest`` -> Ember's internal sampling request
(validated), and internal results -> protobuf ``SampleResponse`` (spec §3.8-3.9)."""

from __future__ import annotations

import math

import numpy as np

from ember.lossdefs import STABILITY_SUPPORT_MAX
from ember.server.wire import tinker_proto as pb
from ember.server.wire.schemas import SampleRequest, TensorDataBody
from ember.server.wire.training import ModelLimits, WireError

MAX_SAMPLES = 128
MAX_TOPK = 64


def _int_list(values, where: str) -> list[int]:
    if not isinstance(values, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in values):
        raise WireError(f"{where} must be a list of integer token ids")
    return values


def prompt_tokens(chunks: list[dict], limits: ModelLimits) -> np.ndarray:
    """The prompt's token ids (text chunks only)."""
    tokens: list[int] = []
    for i, chunk in enumerate(chunks):
        kind = chunk.get("type", "encoded_text")
        if kind != "encoded_text":
            raise WireError(f"prompt.chunks[{i}]: {kind} chunks are not supported; this model takes text tokens")
        tokens += _int_list(chunk.get("tokens"), f"prompt.chunks[{i}].tokens")
    if not tokens:
        raise WireError("prompt is empty")
    arr = np.asarray(tokens, np.int64)
    if arr.min() < 0 or arr.max() >= limits.vocab_size:
        raise WireError(f"prompt token ids must be in [0, {limits.vocab_size}), got {int(arr.min())}..{int(arr.max())}")
    if arr.size >= limits.max_seq_len:
        raise WireError(f"prompt of {arr.size} tokens leaves no room in the context length {limits.max_seq_len}")
    return arr


def _target_tokens(td: TensorDataBody, prompt_len: int) -> tuple[np.ndarray, dict]:
    """``target_prompt_logprobs`` (int64 ``[P-1, K]``, dense or CSR with -1 for unlisted cells) and
    the layout to answer in."""
    shape = td.shape
    if shape is not None and any(n < 0 or n > 1 << 31 for n in shape):
        raise WireError(f"target_prompt_logprobs: shape {shape} must hold sizes between 0 and 2^31")
    data = np.asarray(td.data, dtype=np.int64)
    crow, col = td.sparse_crow_indices, td.sparse_col_indices
    if crow is not None:
        if not shape or len(shape) != 2 or col is None:
            raise WireError("target_prompt_logprobs: sparse CSR needs a 2-D shape and column indices")
        rows, cols = shape
        crow_a, col_a = np.asarray(crow, np.int64), np.asarray(col, np.int64)
        if crow_a.size != rows + 1 or col_a.size != data.size or crow_a[0] != 0 or crow_a[-1] != data.size \
                or np.any(np.diff(crow_a) < 0) or (col_a.size and (col_a.min() < 0 or col_a.max() >= cols)):
            raise WireError(f"target_prompt_logprobs: inconsistent sparse CSR indices for shape {shape}")
        dense = np.full((rows, cols), -1, np.int64)
        dense[np.repeat(np.arange(rows), np.diff(crow_a)), col_a] = data
        layout = {"shape": [rows, cols], "crow": crow_a.tolist(), "col": col_a.tolist()}
    else:
        if shape is None:
            shape = [data.size]
        if int(np.prod(shape)) != data.size:
            raise WireError(f"target_prompt_logprobs: {data.size} values do not fill shape {shape}")
        dense = data.reshape(shape)
        if dense.ndim == 1:
            dense = dense[:, None]
        layout = {"shape": list(shape)}
    if dense.shape[0] != prompt_len - 1:
        raise WireError(f"target_prompt_logprobs must have len(prompt) - 1 = {prompt_len - 1} rows, got {dense.shape[0]}")
    return dense, layout


def decode_sample_request(body: SampleRequest, limits: ModelLimits) -> tuple[dict, int, dict]:
    """Validate an ``asample`` body: ``(internal payload, token cost, reply layout info)``."""
    prompt = prompt_tokens(body.prompt.chunks, limits)
    if not 1 <= body.num_samples <= MAX_SAMPLES:
        raise WireError(f"num_samples={body.num_samples} must be between 1 and {MAX_SAMPLES}")
    sp = body.sampling_params
    room = limits.max_seq_len - prompt.size
    if sp.max_tokens is not None and not 1 <= sp.max_tokens <= room:
        raise WireError(f"sampling_params.max_tokens={sp.max_tokens} must be between 1 and {room} "
                        f"(context length {limits.max_seq_len} minus the prompt)")
    if not (math.isfinite(sp.temperature) and sp.temperature >= 0):
        raise WireError(f"sampling_params.temperature={sp.temperature} must be >= 0")
    if not (math.isfinite(sp.top_p) and 0 < sp.top_p <= 1):
        raise WireError(f"sampling_params.top_p={sp.top_p} must be in (0, 1]")
    for name in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
        k = getattr(body, name)
        if not 0 <= k <= MAX_TOPK:
            raise WireError(f"{name}={k} must be between 0 and {MAX_TOPK}")
    truncated = 0 < sp.top_k < limits.vocab_size or sp.top_p < 1
    if body.record_stability_info and truncated and not 0 < sp.top_k <= STABILITY_SUPPORT_MAX:
        raise WireError(f"record_stability_info with truncated sampling (top_k={sp.top_k}, top_p={sp.top_p}) needs "
                        f"sampling_params.top_k between 1 and {STABILITY_SUPPORT_MAX}: the kept set of every token "
                        "is recorded for stable_reinforce")
    stop = sp.stop
    if isinstance(stop, list) and any(isinstance(s, int) and not 0 <= s < limits.vocab_size for s in stop):
        raise WireError(f"sampling_params.stop token ids must be in [0, {limits.vocab_size})")
    layout: dict = {}
    targets = None
    if body.target_prompt_logprobs is not None:
        targets, layout = _target_tokens(body.target_prompt_logprobs, prompt.size)
        if targets.size and (targets.max() >= limits.vocab_size or targets.min() < -1):
            raise WireError(f"target_prompt_logprobs token ids must be in [0, {limits.vocab_size}) or -1")
    payload = {
        "prompt": prompt,
        "num_samples": body.num_samples,
        "params": {"max_tokens": sp.max_tokens, "temperature": sp.temperature, "top_k": sp.top_k,
                   "top_p": sp.top_p, "seed": sp.seed, "stop": stop},
        "prompt_logprobs": bool(body.prompt_logprobs),
        "prompt_logprobs_last_n": body.prompt_logprobs_last_n,
        "topk_prompt_logprobs": body.topk_prompt_logprobs,
        "topk_sample_logprobs": body.topk_sample_logprobs,
        "target_prompt_logprobs": targets,
        "prompt_alt_tokens_k": body.prompt_alt_tokens_k,
        "record_stability": bool(body.record_stability_info),
    }
    cost = prompt.size + body.num_samples * (sp.max_tokens or room)
    return payload, cost, layout


def _topk(ids, logprobs, msg) -> None:
    ids = np.asarray(ids, "<i4")
    msg.length, msg.k = ids.shape[0], ids.shape[1] if ids.ndim == 2 else 0
    msg.token_ids = ids.tobytes()
    msg.logprobs = np.asarray(logprobs, "<f4").tobytes()


def encode_sample_response(result: dict, layout: dict | None = None) -> bytes:
    """``SampleResponse`` protobuf for a stored sampling result (sequences in sample order)."""
    out = pb.SampleResponse()
    for s in result["sequences"]:
        seq = out.sequences.add()
        seq.stop_reason = pb.STOP_REASON_STOP if s["stop_reason"] == "stop" else pb.STOP_REASON_LENGTH
        seq.tokens = np.asarray(s["tokens"], "<i4").tobytes()
        seq.logprobs = np.asarray(s["logprobs"], "<f4").tobytes()
        if s.get("topk_ids") is not None:
            _topk(s["topk_ids"], s["topk_logprobs"], seq.topk_sampled_logprobs)
    if result.get("prompt_logprobs") is not None:
        out.prompt_logprobs = np.asarray(result["prompt_logprobs"], "<f4").tobytes()
    if result.get("topk_prompt_ids") is not None:
        _topk(result["topk_prompt_ids"], result["topk_prompt_logprobs"], out.topk_prompt_logprobs)
    target = result.get("target_prompt_logprobs")
    if target is not None:
        target = np.asarray(target, "<f4")
        t = out.target_prompt_logprobs
        t.dtype = pb.DTYPE_FLOAT32
        layout = layout or {}
        if "crow" in layout:
            crow, col = np.asarray(layout["crow"], "<i8"), np.asarray(layout["col"], "<i8")
            rows = np.repeat(np.arange(len(crow) - 1), np.diff(crow))
            t.shape.extend(layout["shape"])
            t.sparse_csr.values = target[rows, col].astype("<f4").tobytes()
            t.sparse_csr.crow_indices = crow.tobytes()
            t.sparse_csr.col_indices = col.tobytes()
        else:
            shape = layout.get("shape") or list(target.shape)
            t.shape.extend(shape)
            t.dense = target.reshape(shape).tobytes()
    if result.get("prompt_alt_tokens") is not None:
        for name, value, dtype, kind in (
            ("tokens", result["prompt_alt_tokens"], "<i8", pb.DTYPE_INT64),
            ("logprobs", result["prompt_alt_logprobs"], "<f4", pb.DTYPE_FLOAT32),
        ):
            value = np.asarray(value, dtype)
            t = getattr(out.prompt_alt_tokens, name)
            t.dtype = kind
            t.shape.extend(value.shape)
            t.dense = value.tobytes()
    out.prompt_cache_hit_tokens = 0
    return out.SerializeToString()
