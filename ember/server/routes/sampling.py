"""Sampling endpoints: create_sampling_session, samplers/{id}, asample.

The engine's Worker has no sampler yet, so these answer 501 with a JSON detail instead of
pretending to sample."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from ember.server.auth import require_owner
from ember.server.errors import not_found, not_implemented
from ember.server.routes.common import ember
from ember.server.wire import schemas

router = APIRouter(prefix="/api/v1")
NO_SAMPLER = "sampling is not available: this Ember build's engine has no sampler yet"


@router.post("/create_sampling_session")
def create_sampling_session(
    body: schemas.CreateSamplingSessionRequest, request: Request, owner: str = Depends(require_owner)
) -> dict:
    raise not_implemented(NO_SAMPLER)


@router.get("/samplers/{sampler_id}")
def get_sampler(sampler_id: str, request: Request, owner: str = Depends(require_owner)) -> dict:
    row = ember(request).store.get_sampling_session(sampler_id, owner)
    if row is None:
        raise not_found(f"sampler {sampler_id!r}")
    return {"sampler_id": row.id, "base_model": row.base_model, "model_path": row.model_path}


@router.post("/asample")
def asample(body: schemas.SampleRequest, request: Request, owner: str = Depends(require_owner)) -> dict:
    raise not_implemented(NO_SAMPLER)
