"""OpenAI-compatible inference: ``/oai/api/v1/completions``, ``/oai/api/v1/chat/completions`` and
``/oai/api/v1/models``, authenticated with the Tinker API key (``Authorization: Bearer tml-…``, as
the official ``openai`` client sends it, or ``X-API-Key``), so any OpenAI client, eval harness or
chat UI can sample a base model or a checkpoint while it trains.

``model`` is a served base model's name or a ``tinker://…/sampler_weights/…`` (or ``weights/``)
path the key may read. Requests run as Tinker sampling requests on the same engines and in the same
batches: each key gets one internal session (``openai-compatible``) holding one sampler per model
it uses. Prompts are tokenized in this process with the model's own tokenizer (its chat template
for chat), stop strings are matched by the engine on the decoded text (with the tokenizer's
end-of-sequence and end-of-turn tokens added, so a turn ends where the model ends it), and the
returned text stops before the first stop string, as OpenAI's does.

``stream: true`` answers with server-sent events in OpenAI's chunk format; the chunks are sent
once the engine has finished the sample (the engine does not yet stream tokens as it decodes).
Errors are OpenAI's ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import json
import threading
from functools import cache
from typing import Any

from fastapi import APIRouter, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from ember.server.errors import ApiError
from ember.server.routes.common import ember, readable_checkpoint
from ember.server.routes.futures import outcome
from ember.server.routes.sampling import _submit_sample, require_sampling
from ember.server.wire import schemas
from ember.server.wire.openai import (
    MAX_PROMPTS,
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIError,
    completion_id,
    envelope,
    usage,
)

router = APIRouter(prefix="/oai/api/v1")
TIMEOUT_S = 600.0  # the longest a completion may wait for its engine
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<|eom_id|>")


class Sessions:
    """Each key's internal session and its samplers, by model (re-created if the session ended)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._by_owner: dict[str, tuple[str, dict[str, tuple[str, str]], int]] = {}

    def sampler(self, st, owner: str, model: str) -> tuple[str, str]:
        """``(base model, sampler id)`` for ``owner``'s requests to ``model``."""
        with self._lock:
            entry = self._by_owner.get(owner)
        if entry is None or _heartbeat(st, entry[0], owner) != "active":
            session = st.store.create_session(owner, "openai-compatible", ["openai"], {}, None)
            entry = (session, {}, 0)
        session, samplers, seq = entry
        if model not in samplers:
            base, model_path, weights_uri = _resolve(st, owner, model)
            require_sampling(st, base)
            if st.store.get_sampling_session(st.store.sampler_id(session, seq), owner) is None:
                st.quota.check(owner, "samplers")
            sid = st.store.create_sampling_session(owner=owner, session_id=session, seq=seq, base_model=base,
                                                   model_path=model_path, weights_uri=weights_uri)
            samplers = {**samplers, model: (base, sid)}
            seq += 1
        with self._lock:
            self._by_owner[owner] = (session, samplers, seq)
        return samplers[model]


_SESSIONS = Sessions()


def _heartbeat(st, session: str, owner: str) -> str | None:
    try:
        return st.store.heartbeat(session, owner)
    except KeyError:
        return None


def _resolve(st, owner: str, model: str) -> tuple[str, str | None, str | None]:
    """``(base model, checkpoint path, weights uri)`` of a model name or a tinker:// path."""
    if model.startswith("tinker://"):
        try:
            ckpt = readable_checkpoint(st, owner, model)
        except ApiError as e:
            raise OpenAIError(404 if e.status_code == 404 else 400, f"The model `{model}` does not exist or you do "
                              f"not have access to it ({e.detail})", "model", "model_not_found") from None
        if ckpt.kind == "external":
            raise OpenAIError(400, f"{model} is an external export; use a sampler_weights/ or weights/ path", "model")
        return ckpt.base_model, model, ckpt.uri
    if model not in st.config.models:
        raise OpenAIError(404, f"The model `{model}` does not exist; served models: {sorted(st.config.models)}",
                          "model", "model_not_found")
    return model, None, None


@cache
def _tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def tokenizer(st, base: str):
    """The base model's tokenizer (loaded once per process)."""
    return _tokenizer(str(st.config.models[base].path))


async def _owner(request: Request) -> str:
    auth = request.headers.get("authorization", "")
    key = auth[7:].strip() if auth.lower().startswith("bearer ") else request.headers.get("x-api-key")
    authenticator = ember(request).auth
    try:
        owner = authenticator.cached(key)
        return owner if owner is not None else await run_in_threadpool(authenticator.owner, key)
    except ApiError as e:
        raise OpenAIError(401, f"{e.detail} (send the Tinker API key as the OpenAI API key)",
                          code="invalid_api_key") from None


@router.get("/models")
async def models(request: Request):
    try:
        await _owner(request)
    except OpenAIError as e:
        return JSONResponse(e.body(), status_code=e.status)
    return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "ember"}
                                       for name in sorted(ember(request).config.models)]}


@router.post("/completions")
async def completions(request: Request):
    return await _serve(request, CompletionRequest, chat=False)


@router.post("/chat/completions")
async def chat_completions(request: Request):
    return await _serve(request, ChatCompletionRequest, chat=True)


async def _serve(request: Request, schema, chat: bool):
    try:
        owner = await _owner(request)
        try:
            body = schema.model_validate_json(await request.body())
            stops = body.stops()
        except ValidationError as e:
            err = e.errors()[0]
            loc = ".".join(str(x) for x in err.get("loc", ()))
            raise OpenAIError(400, f"{loc + ': ' if loc else ''}{err.get('msg')}", loc or None) from None
        except ValueError as e:
            raise OpenAIError(400, str(e)) from None
        st = ember(request)
        base, sampler = await run_in_threadpool(_SESSIONS.sampler, st, owner, body.model)
        tok = await run_in_threadpool(tokenizer, st, base)
        prompts = await run_in_threadpool(_prompts, tok, body, chat)
        k = (body.top_logprobs or 0) if chat else (body.logprobs or 0)
        want_logprobs = bool(body.logprobs) if chat else body.logprobs is not None
        ends = [t for t in (tok.eos_token, *END_OF_TURN) if t and t in tok.get_vocab()]
        limit = body.limit() if chat else body.max_tokens
        requests = [schemas.SampleRequest(
            num_samples=body.n, prompt={"chunks": [{"type": "encoded_text", "tokens": p}]},
            sampling_params={"max_tokens": limit, "seed": body.seed, "stop": stops + ends or None,
                             "temperature": body.temperature, "top_p": body.top_p},
            sampling_session_id=sampler, topk_sample_logprobs=k) for p in prompts]
        rids = [(await run_in_threadpool(_submit_sample, st, owner, r))["request_id"] for r in requests]
        results = await asyncio.gather(*(outcome(st, rid, owner, TIMEOUT_S) for rid in rids))
    except OpenAIError as e:
        return JSONResponse(e.body(), status_code=e.status)
    except ApiError as e:
        return JSONResponse(OpenAIError(e.status_code, str(e.detail)).body(), status_code=e.status_code,
                            headers=e.headers)
    for state, _, error in results:
        if state == "failed":
            return JSONResponse(OpenAIError(400, f"sampling failed: {error}").body(), status_code=400)
    seqs = [seq for _, result, _ in results for seq in result["sequences"]]
    choices = await run_in_threadpool(lambda: [_choice(tok, seq, stops, i, chat, want_logprobs, k)
                                               for i, seq in enumerate(seqs)])
    cid = completion_id("chatcmpl" if chat else "cmpl")
    use = usage(sum(len(p) for p in prompts), sum(c.pop("_tokens") for c in choices))
    if body.stream:
        return StreamingResponse(_stream(cid, body.model, choices, chat, use), media_type="text/event-stream")
    for c in choices:
        del c["_pieces"]
    kind = "chat.completion" if chat else "text_completion"
    return JSONResponse(envelope(kind, cid, body.model, choices, usage=use))


def _prompts(tok, body, chat: bool) -> list[list[int]]:
    """The token ids of each prompt (a chat is one prompt, through the chat template)."""
    if chat:
        if not getattr(tok, "chat_template", None):
            raise OpenAIError(400, f"the tokenizer of model {body.model!r} has no chat template; use /completions",
                              "messages")
        try:
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        except ValueError as e:
            raise OpenAIError(400, str(e), "messages") from None
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return [list(ids["input_ids"] if hasattr(ids, "keys") else ids)]
    p = body.prompt
    if isinstance(p, list) and p and not isinstance(p[0], int) and len(p) > MAX_PROMPTS:
        raise OpenAIError(400, f"{len(p)} prompts in one request; at most {MAX_PROMPTS}", "prompt")
    if isinstance(p, str):
        return [tok(p)["input_ids"]]
    if not p:
        raise OpenAIError(400, "prompt is empty", "prompt")
    if all(isinstance(x, int) for x in p):
        return [list(p)]
    if all(isinstance(x, str) for x in p):
        return [tok(x)["input_ids"] for x in p]
    return [list(x) for x in p]


def _choice(tok, seq: dict, stops: list[str], index: int, chat: bool, logprobs: bool, k: int) -> dict:
    """One choice: the text up to the first stop string (special tokens skipped), its finish
    reason and logprobs, and (for streaming) the text piece each token added."""
    tokens = [int(t) for t in seq["tokens"]]
    text = tok.decode(tokens, skip_special_tokens=True)
    pieces = text_pieces(tok, tokens, text)
    finish = "stop" if seq["stop_reason"] == "stop" else "length"
    cut = min((text.find(s) for s in stops if s in text), default=-1)
    if cut >= 0:
        text, finish = text[:cut], "stop"
        kept, total = [], 0
        for piece in pieces:
            if total >= cut:
                break
            kept.append(piece[: cut - total])
            total += len(piece)
        pieces = kept
    lp = _logprobs(tok, tokens[: len(pieces)], seq, chat, k) if logprobs else None
    out: dict[str, Any] = {"index": index, "finish_reason": finish, "logprobs": lp, "_pieces": pieces,
                           "_tokens": len(tokens)}
    if chat:
        out["message"] = {"role": "assistant", "content": text}
    else:
        out["text"] = text
    return out


def text_pieces(tok, tokens: list[int], text: str) -> list[str]:
    """The text each token adds, joining to ``text`` (the decode of all of them): each token is
    decoded in a window that starts at the previous piece's tokens (so a tokenizer that drops a
    leading space at the start of a decode still sees its context), and a piece is held back while
    it ends in an incomplete UTF-8 character. Two short decodes per token, not one of each prefix."""
    pieces, prefix, read = [], 0, 0
    for i in range(len(tokens)):
        before = tok.decode(tokens[prefix:read], skip_special_tokens=True)
        now = tok.decode(tokens[prefix:i + 1], skip_special_tokens=True)
        if len(now) > len(before) and now.startswith(before) and not now.endswith("\ufffd"):
            pieces.append(now[len(before):])
            prefix, read = read, i + 1
        else:
            pieces.append("")
    joined = "".join(pieces)
    if joined != text:  # held-back bytes at the end, or a tokenizer whose windows do not add up
        if text.startswith(joined) and pieces:
            pieces[-1] += text[len(joined):]
        else:
            pieces = [text] + [""] * (len(tokens) - 1) if tokens else []
    return pieces


def _logprobs(tok, tokens: list[int], seq: dict, chat: bool, k: int) -> dict:
    """OpenAI's logprobs of the returned tokens: the model's logprob of each (at temperature 1,
    as Ember's sampler reports them) and its ``k`` most likely alternatives."""
    lps = [float(x) for x in seq["logprobs"]][: len(tokens)]
    top_ids, top_lps = seq.get("topk_ids"), seq.get("topk_logprobs")
    strings = [tok.decode([t]) for t in tokens]

    def top(i: int) -> list[tuple[str, float]]:
        if not k or top_ids is None:
            return []
        return [(tok.decode([int(t)]), float(v)) for t, v in zip(top_ids[i][:k], top_lps[i][:k])]

    if chat:
        return {"content": [{"token": s, "logprob": lp, "bytes": list(s.encode()),
                             "top_logprobs": [{"token": a, "logprob": b, "bytes": list(a.encode())} for a, b in top(i)]}
                            for i, (s, lp) in enumerate(zip(strings, lps))]}
    offsets, pos = [], 0
    for s in strings:
        offsets.append(pos)
        pos += len(s)
    return {"tokens": strings, "token_logprobs": lps, "top_logprobs": [dict(top(i)) for i in range(len(strings))]
            if k else None, "text_offset": offsets}


async def _stream(cid: str, model: str, choices: list[dict], chat: bool, use: dict):
    kind = "chat.completion.chunk" if chat else "text_completion"

    def event(payload: dict) -> str:
        return f"data: {json.dumps(payload)}\n\n"

    if chat:
        yield event(envelope(kind, cid, model, [{"index": c["index"], "delta": {"role": "assistant", "content": ""},
                                                 "finish_reason": None} for c in choices]))
    for c in choices:
        for piece in c["_pieces"]:
            delta = {"delta": {"content": piece}} if chat else {"text": piece, "logprobs": None}
            yield event(envelope(kind, cid, model, [{"index": c["index"], **delta, "finish_reason": None}]))
    for c in choices:
        last = {"delta": {}} if chat else {"text": "", "logprobs": None}
        yield event(envelope(kind, cid, model, [{"index": c["index"], **last, "finish_reason": c["finish_reason"]}]))
    yield event(envelope(kind, cid, model, [], usage=use))
    yield "data: [DONE]\n\n"
