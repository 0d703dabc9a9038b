"""OpenAI's /v1/fine_tuning/jobs: create, list, retrieve, events, checkpoints, cancel.

A job names the served model (`model`; another: 400), a `training_file` (and optionally a
`validation_file`) of the caller's, an optional `suffix`, `seed` and `metadata`, and
`hyperparameters` (or `method.supervised.hyperparameters`; see recipe). What OpenAI defines and
this server does not do is a 400 naming the field: `method.type` "dpo" or "reinforcement",
`integrations` other than []. Fields OpenAI does not define are logged and ignored (as on every
endpoint). A key sees only its own jobs (another's id: 404); an admin key (server.admin) may
cancel anyone's.
"""

from __future__ import annotations

import random
import time
import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from gptserve.server.admin import is_admin
from gptserve.server.errors import APIError
from gptserve.server.fine_tuning import recipe
from gptserve.server.fine_tuning.manager import FineTuning, fine_tuning_on, tenant_of
from gptserve.server.fine_tuning.schemas import (
    STORAGE_ERRORS,
    FineTuningCheckpointList,
    FineTuningEventList,
    FineTuningJob,
    FineTuningJobList,
    FineTuningJobRequest,
)
from gptserve.server.fine_tuning.store import page, public
from gptserve.server.protocol import ERROR_RESPONSES
from gptserve.server.request_fields import refuse_unknown

router = APIRouter(dependencies=[Depends(fine_tuning_on)], tags=["fine-tuning"])
Limit = Annotated[int, Query(ge=1, le=10000)]


def _doc(model: type) -> dict[int | str, dict[str, Any]]:
    return {200: {"model": model}, **ERROR_RESPONSES}


def _job(request: Request, job_id: str, any_owner: bool = False) -> dict[str, Any]:
    ft: FineTuning = request.app.state.fine_tuning
    job = ft.jobs.get(job_id, tenant_of(request), any_owner)
    if job is None:
        raise APIError(404, f"no fine-tuning job {job_id!r}", "fine_tuning_job_id", "not_found")
    return job


def _owned_file(ft: FineTuning, file_id: str, owner: str | None, param: str) -> str:
    ft.expire_files()
    if ft.files.get(file_id, owner) is None:
        raise APIError(400, f"{param}: no file {file_id!r}", param, "invalid_file")
    return file_id


@router.post(
    "/v1/fine_tuning/jobs", response_model=None, responses=_doc(FineTuningJob) | STORAGE_ERRORS
)
async def create_job(request: Request, req: FineTuningJobRequest) -> dict:
    ft: FineTuning = request.app.state.fine_tuning
    refuse_unknown(req.model_extra, "a fine-tuning job")
    if req.integrations:
        raise APIError(
            400, "integrations are not supported (no Weights & Biases reporting here): omit "
            "it or send []", "integrations",
        )  # fmt: skip
    body = req.model_dump(exclude_none=True)
    hyper = recipe.requested_hyperparameters(body)
    ft.state.require_ready()
    owner = tenant_of(request)
    base = ft.state.loaded.name
    if req.model != base:
        raise APIError(
            400, f"model {req.model!r} cannot be fine-tuned here; this server fine-tunes "
            f"{base!r}", "model", "model_not_available",
        )  # fmt: skip
    training = _owned_file(ft, req.training_file, owner, "training_file")
    validation = req.validation_file
    if validation is not None:
        validation = _owned_file(ft, validation, owner, "validation_file")
    suffix = req.suffix
    seed = random.randrange(2**31) if req.seed is None else req.seed
    job = {
        "id": f"ftjob-{uuid.uuid4().hex[:24]}", "object": "fine_tuning.job", "model": base,
        "created_at": int(time.time()), "finished_at": None, "status": "validating_files",
        "trained_tokens": None, "error": None, "result_files": [], "training_file": training,
        "validation_file": validation, "hyperparameters": hyper, "seed": seed, "suffix": suffix,
        "fine_tuned_model": None, "organization_id": "org-gptserve", "estimated_finish": None,
        "integrations": [], "metadata": req.metadata,
        "method": {"type": "supervised", "supervised": {"hyperparameters": hyper}},
        "_owner": owner, "_seq": time.time_ns(), "_metrics": None, "_checkpoints": [],
    }  # fmt: skip
    ft.add_job(job)
    return public(job)


@router.get("/v1/fine_tuning/jobs", response_model=None, responses=_doc(FineTuningJobList))
async def list_jobs(request: Request, after: str | None = None, limit: Limit = 20) -> dict:
    ft: FineTuning = request.app.state.fine_tuning
    jobs = [public(j) for j in ft.jobs.owned(tenant_of(request))][::-1]  # newest first
    return page(jobs, after, limit)


@router.get(
    "/v1/fine_tuning/jobs/{fine_tuning_job_id}", response_model=None, responses=_doc(FineTuningJob)
)
async def retrieve_job(fine_tuning_job_id: str, request: Request) -> dict:
    return public(_job(request, fine_tuning_job_id))


@router.get(
    "/v1/fine_tuning/jobs/{fine_tuning_job_id}/events", response_model=None,
    responses=_doc(FineTuningEventList),
)  # fmt: skip
async def list_events(
    fine_tuning_job_id: str, request: Request, after: str | None = None, limit: Limit = 20
) -> dict:
    events = list(_job(request, fine_tuning_job_id)["_events"])[::-1]  # newest first, as OpenAI
    return page(events, after, limit)


@router.get(
    "/v1/fine_tuning/jobs/{fine_tuning_job_id}/checkpoints", response_model=None,
    responses=_doc(FineTuningCheckpointList),
)  # fmt: skip
async def list_checkpoints(
    fine_tuning_job_id: str, request: Request, after: str | None = None, limit: Limit = 10
) -> dict:
    return page(list(_job(request, fine_tuning_job_id)["_checkpoints"]), after, limit)


@router.post(
    "/v1/fine_tuning/jobs/{fine_tuning_job_id}/cancel",
    response_model=None,
    responses=_doc(FineTuningJob),
)
async def cancel_job(fine_tuning_job_id: str, request: Request) -> dict:
    ft: FineTuning = request.app.state.fine_tuning
    job = _job(request, fine_tuning_job_id, any_owner=is_admin(request))
    ft.cancel(job)
    return public(job)
