"""Training endpoints: create_model, get_info, forward_backward (protobuf), optim_step, checkpoints
(save_weights, save_weights_for_sampler, save_weights_external) and load_weights.

Every submit answers ``{"request_id", "model_id"}`` at once; the work is a future the engine runs
in the model's ``seq_id`` order."""

from __future__ import annotations

import secrets

from fastapi import APIRouter, Depends, Request
from fastapi.concurrency import run_in_threadpool

from ember.lossdefs import LOSS_SPECS, LossSpec
from ember.lossgraph import ProgramError, validate_program
from ember.server.auth import require_owner
from ember.server.errors import ApiError, bad_request
from ember.server.routes.common import (
    active_session,
    check_name,
    ember,
    expiry,
    hot_model,
    live_model,
    readable_checkpoint,
    reject,
    sequenced,
    served_model,
    submit,
    tinker_path,
)
from ember.server.routes.sampling import require_sampling
from ember.server.wire import schemas
from ember.server.wire.training import (
    WireError,
    custom_loss_id,
    decode_forward_backward,
    decompress_zstd,
    leading_ids,
    parse_forward_backward,
    zstd_prefix,
)
from ember.store.models import Checkpoint, TrainingModel
from ember.store.payload import encode
from ember.store.repo import Conflict, utcnow

router = APIRouter(prefix="/api/v1")

_FB_REPLY = {"proto": "forward_backward"}  # what retrieve_future answers with (stored with the request)
_OPTIM_REPLY = {"type": "optim_step", "result_keys": ["metrics"]}
LORA_ALPHA = 32.0  # Tinker does not send alpha; tinker-cookbook assumes 32 (spec §3.10)


def _optimizer_config(config: dict | None) -> dict:
    kind = (config or {}).get("type", "adamw")
    if kind != "adamw":
        raise bad_request(f"optimizer_config.type {kind!r} is not supported; Ember trains with 'adamw'")
    return {"type": "adamw"}


def _ember_lora(lora: schemas.LoraConfigBody, max_rank: int, full_finetune: bool) -> dict:
    """Tinker's LoraConfig -> Ember's (``rank``, ``alpha`` = 32, ``targets``, ``seed``). Rank 0 is
    Ember's extension: full fine-tuning (every weight of the run's own copy of the model), on a
    server started with ``--full-finetune``."""
    if lora.rank == 0:
        if not full_finetune:
            raise bad_request("lora_config.rank=0 asks for full fine-tuning, which this server does not offer "
                              "(start it with --full-finetune)")
        return {"rank": 0, "alpha": 0.0, "targets": ["attn", "mlp", "unembed"], "seed": 0}
    if not 1 <= lora.rank <= max_rank:
        raise bad_request(f"lora_config.rank={lora.rank} must be between 1 and {max_rank} (the server's --max-rank)")
    targets = [name for name, on in (("attn", lora.train_attn), ("mlp", lora.train_mlp), ("unembed", lora.train_unembed)) if on]
    if not targets:
        raise bad_request("lora_config: at least one of train_attn, train_mlp, train_unembed must be true")
    seed = lora.seed if lora.seed is not None else secrets.randbelow(2**31)
    return {"rank": lora.rank, "alpha": LORA_ALPHA, "targets": targets, "seed": int(seed)}


def tinker_lora(lora: dict) -> dict:
    """Ember's LoRA config -> Tinker's fields (``weights_info``)."""
    targets = set(lora.get("targets", ()))
    return {
        "rank": lora["rank"], "seed": lora.get("seed"),
        "train_attn": "attn" in targets, "train_mlp": "mlp" in targets, "train_unembed": "unembed" in targets,
    }


def _accepted(request_id: str, model_id: str) -> dict:
    return {"request_id": request_id, "model_id": model_id}


@router.post("/create_model")
def create_model(body: schemas.CreateModelRequest, request: Request, owner: str = Depends(require_owner)) -> dict:
    st = ember(request)
    active_session(st, owner, body.session_id)
    served_model(st, body.base_model)
    lora = _ember_lora(body.lora_config, st.config.max_rank, st.config.full_finetune)
    model_id = f"{body.session_id}:train:{body.model_seq_id}"
    rid = _submit_model(
        st, owner=owner, session_id=body.session_id, model_seq_id=body.model_seq_id, base_model=body.base_model,
        lora=lora, optimizer_config=_optimizer_config(body.optimizer_config), user_metadata=body.user_metadata or {},
        op="create_model", payload=encode({"lora": lora}), reply={"model_id": model_id, "type": "create_model"},
    )
    return _accepted(rid, model_id)


def _submit_model(st, **kwargs) -> str:
    owner = kwargs["owner"]
    if st.store.get_model(f"{kwargs['session_id']}:train:{kwargs['model_seq_id']}", owner) is None:  # not a retry
        st.quota.check(owner, "training_runs")
    st.quota.check(owner, "queued_requests")
    try:
        rid = st.store.submit_model(**kwargs)
    except Conflict as e:
        raise bad_request(str(e)) from None
    st.ring(kwargs["base_model"])
    return rid


def info_json(st, model: TrainingModel) -> dict:
    served = st.config.models.get(model.base_model)
    return {
        "type": "get_info",
        "model_id": model.id,
        "model_data": {
            "arch": served.arch if served else None,
            "model_name": model.base_model,
            "tokenizer_id": str(served.path) if served else None,
        },
        "optimizer_config": model.optimizer_config,
        "is_lora": model.lora["rank"] > 0,  # rank 0: full fine-tuning
        "lora_rank": model.lora["rank"] or None,
        "model_name": model.base_model,
    }


@router.post("/get_info")
def get_info(body: schemas.GetInfoRequest, request: Request, owner: str = Depends(require_owner)) -> dict:
    st = ember(request)
    model = st.store.get_model(body.model_id, owner)
    if model is None:
        raise ApiError(404, f"model {body.model_id!r} not found")
    return info_json(st, model)


@router.post("/forward_backward")
async def forward_backward(request: Request, owner: str = Depends(require_owner)) -> dict:
    """Protobuf ``ForwardBackwardRequest`` (optionally ``Content-Encoding: zstd``); ``forward()``
    is the same call with ``forward_only``."""
    st = ember(request)
    ctype = request.headers.get("content-type", "")
    if "application/x-protobuf" not in ctype:
        raise bad_request(
            f"forward_backward takes a protobuf body (Content-Type: application/x-protobuf, tinker>=0.25), got {ctype!r}"
        )
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity", "zstd"):
        raise bad_request(f"Content-Encoding {encoding!r} is not supported (use zstd or none)")
    limit = st.config.max_body_bytes
    body, whole = await _read_body(request, limit)
    if not whole:
        await run_in_threadpool(_reject_oversized, st, owner, body, encoding, f"request body exceeds {limit} bytes")
    if encoding == "zstd":
        try:
            body = await run_in_threadpool(decompress_zstd, body, limit)
        except OverflowError as e:
            await run_in_threadpool(_reject_oversized, st, owner, body, encoding, str(e))
        except WireError as e:
            raise bad_request(str(e)) from None
    try:
        msg = parse_forward_backward(body)
    except WireError as e:
        raise bad_request(str(e)) from None
    return await run_in_threadpool(_submit_forward_backward, st, owner, msg)


async def _read_body(request: Request, limit: int, prefix: int = 4096) -> tuple[bytes, bool]:
    """``(body, True)``, or ``(first bytes, False)`` once the body is known to exceed ``limit``."""
    declared = request.headers.get("content-length", "")
    too_big = declared.isdigit() and int(declared) > limit
    chunks, seen = [], 0
    async for chunk in request.stream():
        chunks.append(chunk)
        seen += len(chunk)
        if seen > limit or (too_big and seen >= prefix):
            return b"".join(chunks)[:prefix], False
    return b"".join(chunks), not too_big


def _reject_oversized(st, owner: str, body: bytes, encoding: str, message: str) -> None:
    """Raise 413 for a body over the limit; first record the request its first bytes name as
    rejected, so that it still takes its seq_id and the model's later requests are not held up."""
    ids = leading_ids(zstd_prefix(body) if encoding == "zstd" else body)
    if ids is not None:
        model = st.store.get_model(ids[0], owner)
        if model is not None and model.status == "active" and ids[1] >= 1:
            reject(st, owner, model, "forward_backward", ids[1], message)
    raise ApiError(413, message)


def _custom_loss(st, owner: str, model: TrainingModel, msg) -> dict | None:
    """The program of a ``loss_fn="custom"`` request (None for built-in losses); 400 unless its
    ``loss_id`` is a loss of the model's session."""
    try:
        loss_id = custom_loss_id(msg)
    except WireError as e:
        raise bad_request(str(e)) from None
    if loss_id is None:
        return None
    cached = st.custom_losses.get(loss_id)
    program = cached[1] if cached is not None and cached[0] == owner else st.store.get_custom_loss(loss_id, owner)
    if program is None:
        raise bad_request(f"unknown loss_id {loss_id!r}; create it with create_custom_loss")
    if cached is None:
        if len(st.custom_losses) >= 4096:
            st.custom_losses.clear()
        st.custom_losses[loss_id] = (owner, program)  # a stored loss never changes
    if program["session_id"] != model.session_id:
        raise bad_request(f"loss {loss_id!r} belongs to another session; create it in this model's session")
    return program


def _submit_forward_backward(st, owner: str, msg) -> dict:
    model, checked = hot_model(st, owner, msg.model_id)
    if msg.seq_id < 1:
        if not checked:
            live_model(st, owner, model.id)
        raise bad_request(f"seq_id must be >= 1, got {msg.seq_id}")
    with sequenced(st, owner, model, "forward_backward", msg.seq_id, checked):
        program = _custom_loss(st, owner, model, msg)
        try:
            decoded = decode_forward_backward(msg, st.config.models[model.base_model].limits, program)
        except WireError as e:
            raise bad_request(str(e)) from None
        if LOSS_SPECS.get(decoded.loss_fn, LossSpec(())).needs_provenance:
            decoded.payload["session_id"] = model.session_id  # whose stability records the spans may name
        rid = submit(
            st, owner=owner, base_model=model.base_model, op="forward_backward", payload=encode(decoded.payload),
            model_id=model.id, seq_id=decoded.seq_id, n_tokens=decoded.n_tokens, reply=_FB_REPLY, live=not checked,
        )
    st.remember(rid, owner, _FB_REPLY)
    return _accepted(rid, model.id)


@router.post("/create_custom_loss")
def create_custom_loss(body: schemas.CreateCustomLossRequest, request: Request, owner: str = Depends(require_owner)) -> dict:
    """Store a loss traced by the SDK (``ServiceClient.create_custom_loss`` with the client flag
    ``custom_loss_server_side``); ``forward_backward`` with ``loss_fn="custom"`` and its ``loss_id``
    then runs it in the engine, one call per datum, summed. Checked here against the allow-list of
    :mod:`ember.lossgraph`; the future is finished at once with ``{"loss_id"}``."""
    st = ember(request)
    active_session(st, owner, body.session_id)
    try:
        program = validate_program(body.name, body.inputs, body.graph)
    except ProgramError as e:
        raise bad_request(f"create_custom_loss: {e}") from None
    rid = st.store.create_custom_loss(owner=owner, session_id=body.session_id, seq=body.custom_loss_seq_id,
                                      program=program)
    return {"request_id": rid}


@router.post("/optim_step")
async def optim_step(body: schemas.OptimStepRequest, request: Request, owner: str = Depends(require_owner)) -> dict:
    # async with one thread-pool hop for the store (a sync route would take a second one to
    # serialise its answer): this route is on every training step's path
    return await run_in_threadpool(_submit_optim_step, ember(request), owner, body)


def _submit_optim_step(st, owner: str, body: schemas.OptimStepRequest) -> dict:
    model, checked = hot_model(st, owner, body.model_id)
    with sequenced(st, owner, model, "optim_step", body.seq_id, checked):
        params = body.adam_params.model_dump() if body.adam_params else (body.optim_params or body.optimizer_params)
        if params is None:
            raise bad_request("optim_step needs adam_params")
        if params.get("type") not in (None, "adam", "adamw"):
            raise bad_request(f"optimizer params of type {params['type']!r} are not supported; use AdamParams")
        try:
            adam = schemas.AdamParamsBody.model_validate(params).model_dump(exclude={"type"})
        except ValueError as e:
            raise bad_request(f"invalid adam_params: {e}") from None
        rid = submit(
            st, owner=owner, base_model=model.base_model, op="optim_step", payload=encode({"adam": adam}),
            model_id=model.id, seq_id=body.seq_id, reply=_OPTIM_REPLY, live=not checked,
        )
    st.remember(rid, owner, _OPTIM_REPLY)
    return _accepted(rid, model.id)


def _save(st, owner: str, model: TrainingModel, seq_id: int, kind: str, name: str, *, ttl: int | None,
          user_metadata: dict | None, overwrite: bool, reply_type: str, op: str = "save_weights",
          extra: dict | None = None) -> dict:
    """Queue a checkpoint write (the name and TTL are validated by the caller inside ``sequenced``)."""
    st.quota.check(owner, "checkpoint_bytes")
    path = tinker_path(model.id, kind, name)
    uri = st.storage.uri_for(owner, model.id, kind, name)
    ckpt = Checkpoint(
        tinker_path=path, owner=owner, model_id=model.id, kind=kind, name=name, uri=uri, state="pending",
        base_model=model.base_model, lora=model.lora, optimizer_config=model.optimizer_config,
        user_metadata=user_metadata, created_at=utcnow(), expires_at=expiry(ttl),
        encrypted=bool((extra or {}).get("recipients")), public=False,
    )
    payload = {"uri": uri, "tinker_path": path, "with_optimizer": kind == "training",
               "metadata": {"tinker_path": path, "base_model_name": model.base_model}, **(extra or {})}
    reply = {"path": path, "type": reply_type}
    if kind == "external":
        reply["result_keys"] = ["size_bytes"]
    rid = submit(
        st, owner=owner, base_model=model.base_model, op=op, payload=encode(payload), model_id=model.id,
        seq_id=seq_id, checkpoint=ckpt, overwrite=overwrite, reply=reply,
    )
    return _accepted(rid, model.id)


@router.post("/save_weights")
def save_weights(body: schemas.SaveWeightsRequest, request: Request, owner: str = Depends(require_owner)) -> dict:
    st = ember(request)
    model = live_model(st, owner, body.model_id)
    with sequenced(st, owner, model, "save_weights", body.seq_id):
        return _save(st, owner, model, body.seq_id, "training", check_name(body.path), ttl=body.ttl_seconds,
                     user_metadata=body.user_metadata, overwrite=body.overwrite, reply_type="save_weights")


@router.post("/save_weights_for_sampler")
def save_weights_for_sampler(
    body: schemas.SaveWeightsForSamplerRequest, request: Request, owner: str = Depends(require_owner)
) -> dict:
    st = ember(request)
    model = live_model(st, owner, body.model_id)
    with sequenced(st, owner, model, "save_weights_for_sampler", body.seq_id):
        if body.path is not None:
            return _save(st, owner, model, body.seq_id, "sampler", check_name(body.path), ttl=body.ttl_seconds,
                         user_metadata=body.user_metadata, overwrite=False, reply_type="save_weights_for_sampler")
    # Ephemeral (save_weights_and_get_sampling_client): a sampler over a snapshot of the weights.
    with sequenced(st, owner, model, "save_weights_for_sampler", body.seq_id):
        if body.sampling_session_seq_id is None:
            raise bad_request("save_weights_for_sampler needs path (named) or sampling_session_seq_id (ephemeral)")
        if body.kind not in ("snapshot", "inflight"):
            raise bad_request(f"kind {body.kind!r} must be 'snapshot' or 'inflight'")
        require_sampling(st, model.base_model)
        if st.store.get_sampling_session(st.store.sampler_id(model.session_id, body.sampling_session_seq_id), owner) is None:
            st.quota.check(owner, "samplers")
        sid = st.store.create_sampling_session(
            owner=owner, session_id=model.session_id, seq=body.sampling_session_seq_id, base_model=model.base_model,
            model_path=None, weights_uri=None, source_model_id=model.id,
        )
        rid = submit(st, owner=owner, base_model=model.base_model, op="snapshot_sampler",
                     payload=encode({"sampler_id": sid}), model_id=model.id, seq_id=body.seq_id,
                     reply={"sampling_session_id": sid, "type": "save_weights_for_sampler"})
    return _accepted(rid, model.id)


@router.post("/save_weights_external")
def save_weights_external(
    body: schemas.SaveWeightsExternalRequest, request: Request, owner: str = Depends(require_owner)
) -> dict:
    st = ember(request)
    model = live_model(st, owner, body.model_id)
    with sequenced(st, owner, model, "save_weights_external", body.seq_id):
        recipients = body.age_encryption_recipients or []
        if len(recipients) > 10:
            raise bad_request(f"age_encryption_recipients: at most 10 recipients, got {len(recipients)}")
        for r in recipients:
            if not (r.startswith(("age1", "ssh-"))):
                raise bad_request(f"age_encryption_recipients: {r[:24]!r} is neither an age1… key nor an SSH public key")
        return _save(st, owner, model, body.seq_id, "external", check_name(body.path), ttl=body.ttl_seconds,
                     user_metadata=None, overwrite=True, reply_type="save_weights_external", op="save_external",
                     extra={"recipients": recipients, "base_model": model.base_model})


@router.post("/load_weights")
def load_weights(body: schemas.LoadWeightsRequest, request: Request, owner: str = Depends(require_owner)) -> dict:
    """Create a model from a checkpoint (``session_id`` + ``model_seq_id``) or, for the deprecated
    ``TrainingClient.load_state``, replace a model's weights in place (``model_id`` + ``seq_id``)."""
    st = ember(request)

    def source() -> tuple[Checkpoint, bytes]:
        ckpt = readable_checkpoint(st, owner, body.path)
        if ckpt.kind == "external":
            raise bad_request(f"{body.path} is an external export; load a weights/ or sampler_weights/ checkpoint")
        if body.optimizer and ckpt.kind != "training":
            raise bad_request(f"{body.path} has no optimizer state (only weights/ checkpoints from save_state do)")
        return ckpt, encode({"uri": ckpt.uri, "with_optimizer": body.optimizer, "source_path": body.path})

    if body.model_id is not None:
        model = live_model(st, owner, body.model_id)
        if body.seq_id is None:
            raise bad_request("load_weights with model_id needs seq_id")
        with sequenced(st, owner, model, "load_weights", body.seq_id):
            ckpt, payload = source()
            if ckpt.base_model != model.base_model:
                raise bad_request(f"{body.path} is for base model {ckpt.base_model}, not {model.base_model}")
            rid = submit(st, owner=owner, base_model=model.base_model, op="load_weights", payload=payload,
                         model_id=model.id, seq_id=body.seq_id, reply={"path": body.path, "type": "load_weights"})
        return _accepted(rid, model.id)
    ckpt, payload = source()
    if body.session_id is None or body.model_seq_id is None:
        raise bad_request("load_weights needs session_id and model_seq_id (or model_id and seq_id)")
    active_session(st, owner, body.session_id)
    if body.base_model is not None and body.base_model != ckpt.base_model:
        raise bad_request(f"{body.path} was trained on {ckpt.base_model!r}, not {body.base_model!r}")
    served_model(st, ckpt.base_model)
    optimizer = ckpt.optimizer_config if body.optimizer else _optimizer_config(body.optimizer_config)
    model_id = f"{body.session_id}:train:{body.model_seq_id}"
    rid = _submit_model(
        st, owner=owner, session_id=body.session_id, model_seq_id=body.model_seq_id, base_model=ckpt.base_model,
        lora=ckpt.lora, optimizer_config=optimizer, user_metadata=body.user_metadata or {}, op="load_model",
        payload=payload, reply={"model_id": model_id, "path": body.path, "type": "load_weights"},
    )
    return _accepted(rid, model_id)

