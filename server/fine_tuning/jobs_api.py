"""OpenAI's /v1/fine_tuning/jobs: create, list, retrieve, events, checkpoints, cancel.

A job names the served model (`model`; another: 400), a `training_file` (and optionally a
`validation_file`) of the caller's, an optional `suffix` and `seed`, and `hyperparameters` (or
`method.supervised.hyperparameters`; see recipe). A key sees only its own jobs (another's id:
404); an admin key (server.admin) may cancel anyone's.
"""

from __future__ import annotations

import random
import re
import time
import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Request
from gptserve.server.admin import is_admin
from gptserve.server.errors import APIError
from gptserve.server.fine_tuning import recipe
from gptserve.server.fine_tuning.manager import FineTuning, fine_tuning_on, tenant_of
from gptserve.server.fine_tuning.store import page, public

# out of /openapi.json for now: it has no response models yet, and tests/server/test_fuzz.py fuzzes
# every operation the schema lists
router = APIRouter(dependencies=[Depends(fine_tuning_on)], include_in_schema=False)
SUFFIX = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _job(request: Request, job_id: str, any_owner: bool = False) -> dict[str, Any]:
    ft: FineTuning = request.app.state.fine_tuning
    job = ft.jobs.get(job_id, tenant_of(request), any_owner)
    if job is None:
        raise APIError(404, f"no fine-tuning job {job_id!r}", "fine_tuning_job_id", "not_found")
    return job


def _owned_file(ft: FineTuning, file_id: Any, owner: str | None, param: str) -> str:
    if not isinstance(file_id, str) or ft.files.get(file_id, owner) is None:
        raise APIError(400, f"{param}: no file {file_id!r}", param, "invalid_file")
    return file_id


@router.post("/v1/fine_tuning/jobs")
async def create_job(request: Request, body: Annotated[dict[str, Any], Body()]) -> dict:
    ft: FineTuning = request.app.state.fine_tuning
    ft.state.require_ready()
    owner = tenant_of(request)
    base = ft.state.loaded.name
    if body.get("model") != base:
        raise APIError(
            400, f"model {body.get('model')!r} cannot be fine-tuned here; this server "
            f"fine-tunes {base!r}", "model", "model_not_available",
        )  # fmt: skip
    training = _owned_file(ft, body.get("training_file"), owner, "training_file")
    validation = body.get("validation_file")
    if validation is not None:
        validation = _owned_file(ft, validation, owner, "validation_file")
    suffix = body.get("suffix")
    if suffix is not None and not (isinstance(suffix, str) and SUFFIX.fullmatch(suffix)):
        raise APIError(400, "suffix: 1 to 64 of A-Z a-z 0-9 _ -", "suffix")
    seed = body.get("seed")
    if seed is None:
        seed = random.randrange(2**31)
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**31:
        raise APIError(400, "seed must be an integer in [0, 2**31)", "seed")
    hyper = recipe.requested_hyperparameters(body)
    job = {
        "id": f"ftjob-{uuid.uuid4().hex[:24]}", "object": "fine_tuning.job", "model": base,
        "created_at": int(time.time()), "finished_at": None, "status": "validating_files",
        "trained_tokens": None, "error": None, "result_files": [], "training_file": training,
        "validation_file": validation, "hyperparameters": hyper, "seed": seed, "suffix": suffix,
        "fine_tuned_model": None, "organization_id": "org-gptserve", "estimated_finish": None,
        "integrations": [], "metadata": body.get("metadata"),
        "method": {"type": "supervised", "supervised": {"hyperparameters": hyper}},
        "_owner": owner, "_seq": time.time_ns(), "_metrics": None, "_checkpoints": [],
    }  # fmt: skip
    ft.add_job(job)
    return public(job)


@router.get("/v1/fine_tuning/jobs")
async def list_jobs(request: Request, after: str | None = None, limit: int = 20) -> dict:
    ft: FineTuning = request.app.state.fine_tuning
    jobs = [public(j) for j in ft.jobs.owned(tenant_of(request))][::-1]  # newest first
    return page(jobs, after, max(1, limit))


@router.get("/v1/fine_tuning/jobs/{job_id}")
async def retrieve_job(job_id: str, request: Request) -> dict:
    return public(_job(request, job_id))


@router.get("/v1/fine_tuning/jobs/{job_id}/events")
async def list_events(
    job_id: str, request: Request, after: str | None = None, limit: int = 20
) -> dict:
    events = list(_job(request, job_id)["_events"])[::-1]  # newest first, as OpenAI lists them
    return page(events, after, max(1, limit))


@router.get("/v1/fine_tuning/jobs/{job_id}/checkpoints")
async def list_checkpoints(
    job_id: str, request: Request, after: str | None = None, limit: int = 10
) -> dict:
    return page(list(_job(request, job_id)["_checkpoints"]), after, max(1, limit))


@router.post("/v1/fine_tuning/jobs/{job_id}/cancel")
async def cancel_job(job_id: str, request: Request) -> dict:
    ft: FineTuning = request.app.state.fine_tuning
    job = _job(request, job_id, any_owner=is_admin(request))
    ft.cancel(job)
    return public(job)
