"""Sampling endpoints: create_sampling_session (base model, or a checkpoint's weights),
samplers/{id}, join_sampling_session (a client number for an unpickled SamplingClient), and asample
(a future whose result is a protobuf ``SampleResponse``). ``compute_logprobs`` is ``asample`` with
``max_tokens=1`` and prompt logprobs."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.concurrency import run_in_threadpool

from ember.server.auth import require_owner
from ember.server.errors import ApiError, bad_request, not_found
from ember.server.routes.common import active_session, ember, readable_checkpoint, served_model, submit
from ember.server.wire import schemas
from ember.server.wire.sampling import decode_sample_request
from ember.server.wire.training import WireError
from ember.store.payload import encode
from ember.store.repo import Conflict

router = APIRouter(prefix="/api/v1")


def require_sampling(st, base_model: str) -> None:
    """501 (not retried: ``x-should-retry: false``) when the engine of ``base_model`` cannot sample."""
    for e in st.store.engines():
        if e.base_model == base_model and "sample" not in (e.capabilities or []):
            raise ApiError(501, f"the engine serving {base_model!r} has no sampler")


@router.post("/create_sampling_session")
def create_sampling_session(
    body: schemas.CreateSamplingSessionRequest, request: Request, owner: str = Depends(require_owner)
) -> dict:
    st = ember(request)
    active_session(st, owner, body.session_id)
    model_path, weights_uri = None, None
    if body.model_path is not None:
        ckpt = readable_checkpoint(st, owner, body.model_path)
        if ckpt.kind == "external":
            raise bad_request(f"{body.model_path} is an external export; sample from sampler_weights/ or weights/")
        if body.base_model is not None and body.base_model != ckpt.base_model:
            raise bad_request(f"{body.model_path} belongs to base model {ckpt.base_model!r}, not {body.base_model!r}")
        base, model_path, weights_uri = ckpt.base_model, body.model_path, ckpt.uri
    elif body.base_model is not None:
        base = body.base_model
    else:
        raise bad_request("create_sampling_session needs base_model or model_path")
    served_model(st, base)
    require_sampling(st, base)
    if st.store.get_sampling_session(st.store.sampler_id(body.session_id, body.sampling_session_seq_id), owner) is None:
        st.quota.check(owner, "samplers")
    sid = st.store.create_sampling_session(
        owner=owner,
        session_id=body.session_id,
        seq=body.sampling_session_seq_id,
        base_model=base,
        model_path=model_path,
        weights_uri=weights_uri,
    )
    return {"sampling_session_id": sid, "type": "create_sampling_session"}


@router.get("/samplers/{sampler_id}")
def get_sampler(sampler_id: str, request: Request, owner: str = Depends(require_owner)) -> dict:
    row = ember(request).store.get_sampling_session(sampler_id, owner)
    if row is None:
        raise not_found(f"sampler {sampler_id!r}")
    return {"sampler_id": row.id, "base_model": row.base_model, "model_path": row.model_path}


@router.post("/join_sampling_session")
def join_sampling_session(
    body: schemas.JoinSamplingSessionRequest, request: Request, owner: str = Depends(require_owner)
) -> dict:
    """A client number unique within the sampler (flag ``sample_join_sampling_session``): an
    unpickled SamplingClient numbers its requests ``1e9 * client_counter + k``, so that copies
    never collide on seq_ids (the original client is 0; joins get 1, 2, 3, ...)."""
    st = ember(request)
    sampler = st.store.get_sampling_session(body.sampling_session_id, owner)
    if sampler is None:
        raise not_found(f"sampler {body.sampling_session_id!r}")
    active_session(st, owner, sampler.session_id)
    try:
        counter = st.store.join_sampler(sampler.id, owner)
    except Conflict as e:
        raise bad_request(str(e)) from None
    if counter is None:
        raise not_found(f"sampler {body.sampling_session_id!r}")
    return {"client_counter": counter, "type": "join_sampling_session"}


@router.post("/asample")
async def asample(body: schemas.SampleRequest, request: Request, owner: str = Depends(require_owner)) -> dict:
    return await run_in_threadpool(_submit_sample, ember(request), owner, body)  # one thread-pool hop


def _submit_sample(st, owner: str, body: schemas.SampleRequest) -> dict:
    if body.sampling_session_id is None:
        raise bad_request("asample needs sampling_session_id (create one with create_sampling_session)")
    sampler = st.store.get_sampling_session(body.sampling_session_id, owner)
    if sampler is None:
        raise not_found(f"sampler {body.sampling_session_id!r}")
    active_session(st, owner, sampler.session_id)
    require_sampling(st, sampler.base_model)
    try:
        payload, cost, layout = decode_sample_request(body, st.config.models[sampler.base_model].limits)
    except WireError as e:
        raise bad_request(str(e)) from None
    kind = "snapshot" if sampler.source_model_id else ("checkpoint" if sampler.weights_uri else "base")
    payload.update(kind=kind, weights_uri=sampler.weights_uri, model_path=sampler.model_path,
                   session_id=sampler.session_id)  # stability records belong to the session
    rid = submit(
        st,
        owner=owner,
        base_model=sampler.base_model,
        op="sample",
        payload=encode(payload),
        sampler_id=sampler.id,
        seq_id=body.seq_id,
        n_tokens=cost,
        reply=(reply := {"proto": "sample", "layout": layout}),
    )
    st.remember(rid, owner, reply)  # its retrieve_future reads no row while it is pending
    return {"request_id": rid, "sample_sequence_ids": [f"{rid}:{i}" for i in range(body.num_samples)]}
