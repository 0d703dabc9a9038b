"""The files and fine-tuning jobs API's bodies, as /openapi.json describes them.

`FineTuningJobRequest` is validated (a wrong type or bound: a 400 naming the field); the
answers are built as plain dicts by the handlers (store.public) and these models only document
them, so that tests/server/test_fuzz.py can check every answer against its schema.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from gptserve.server.fine_tuning.recipe import BOUNDS
from gptserve.server.protocol import ERROR_RESPONSES, ErrorBody
from pydantic import BaseModel, ConfigDict, Field

Auto = Literal["auto"]
_EPOCHS, _BATCH, _LR = (BOUNDS[k] for k in ("n_epochs", "batch_size", "learning_rate_multiplier"))


class _Closed(BaseModel):
    """An object whose unknown keys are a 400 (a typo must not train with the defaults)."""

    model_config = ConfigDict(strict=True, extra="forbid")


class FineTuningHyperparameters(_Closed):
    n_epochs: Auto | Annotated[int, Field(ge=_EPOCHS[0], le=_EPOCHS[1])] | None = Field(
        None, description="passes over the training file (auto: 3)"
    )
    batch_size: Auto | Annotated[int, Field(ge=_BATCH[0], le=_BATCH[1])] | None = Field(
        None, description="examples a step (auto: min(4, examples))"
    )
    learning_rate_multiplier: Auto | Annotated[float, Field(ge=_LR[0], le=_LR[1])] | None = Field(
        None, description="times the base learning rate, 2e-3 (auto: 1)"
    )


class FineTuningSupervised(_Closed):
    hyperparameters: FineTuningHyperparameters | None = None


class FineTuningMethod(_Closed):
    type: Literal["supervised", "dpo", "reinforcement"] = Field(
        "supervised", description="only 'supervised' is trained; the others are a 400"
    )
    supervised: FineTuningSupervised | None = None
    dpo: dict[str, Any] | None = Field(None, description="not supported: omit or null")
    reinforcement: dict[str, Any] | None = Field(None, description="not supported: omit or null")


class FineTuningJobRequest(BaseModel):
    """OpenAI's fine_tuning.jobs.create body. Fields it does not define are logged and ignored,
    as on every other endpoint (server.request_fields)."""

    model_config = ConfigDict(strict=True, extra="allow")

    model: str = Field(description="the served model's name")
    training_file: str = Field(description="a file id of the caller's (purpose fine-tune)")
    validation_file: str | None = None
    hyperparameters: FineTuningHyperparameters | None = None
    method: FineTuningMethod | None = None
    suffix: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")] | None = None
    seed: Annotated[int, Field(ge=0, lt=2**31)] | None = None
    metadata: (
        Annotated[dict[str, Annotated[str, Field(max_length=512)]], Field(max_length=16)] | None
    ) = None
    integrations: list[dict[str, Any]] | None = Field(
        None, description="not supported (no Weights & Biases reporting): omit, null or []"
    )


# ---- answers (documentation only) ------------------------------------------------------------


class FileObject(BaseModel):
    id: str
    object: Literal["file"]
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: str
    status_details: str | None = None
    expires_at: int | None = None


class FileList(BaseModel):
    object: Literal["list"]
    data: list[FileObject]
    has_more: bool


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"]
    deleted: bool


class FineTuningJobError(BaseModel):
    code: str
    message: str
    param: str | None = None


class FineTuningJob(BaseModel):
    id: str
    object: Literal["fine_tuning.job"]
    model: str
    created_at: int
    finished_at: int | None
    status: Literal["validating_files", "queued", "running", "succeeded", "failed", "cancelled"]
    trained_tokens: int | None
    error: FineTuningJobError | None
    result_files: list[str]
    training_file: str
    validation_file: str | None
    hyperparameters: dict[str, Any]
    seed: int
    suffix: str | None
    fine_tuned_model: str | None
    organization_id: str
    estimated_finish: int | None
    integrations: list[dict[str, Any]]
    metadata: dict[str, str] | None
    method: dict[str, Any]


class FineTuningJobList(BaseModel):
    object: Literal["list"]
    data: list[FineTuningJob]
    has_more: bool


class FineTuningEvent(BaseModel):
    id: str
    object: Literal["fine_tuning.job.event"]
    created_at: int
    level: Literal["info", "warn", "error"]
    message: str
    data: dict[str, Any] | None
    type: Literal["message", "metrics"]


class FineTuningEventList(BaseModel):
    object: Literal["list"]
    data: list[FineTuningEvent]
    has_more: bool


class FineTuningCheckpoint(BaseModel):
    id: str
    object: Literal["fine_tuning.job.checkpoint"]
    created_at: int
    fine_tuned_model_checkpoint: str
    fine_tuning_job_id: str
    step_number: int
    metrics: dict[str, Any]


class FineTuningCheckpointList(BaseModel):
    object: Literal["list"]
    data: list[FineTuningCheckpoint]
    has_more: bool


STORAGE_ERRORS: dict[int | str, dict[str, Any]] = {
    **ERROR_RESPONSES,
    507: {"model": ErrorBody, "description": "the state directory cannot be written (disk full)"},
}
