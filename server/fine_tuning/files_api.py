"""OpenAI's /v1/files for fine-tuning data: upload, list, retrieve, content, delete.

Only `purpose: "fine-tune"` is taken (others: 400). An upload is at most --max-file-bytes (413
above), UTF-8 JSONL that training.chat_data.check_chat_file accepts (structure only: the
template and token checks run when a job starts); a bad file is a 400 naming its first bad line.
`expires_after` (`expires_after[anchor]` "created_at" and `expires_after[seconds]`, 3600 to
2592000, both or neither) sets `expires_at`, after which the file is deleted. Other form fields are
logged and ignored, as unknown fields are on every endpoint. The file and its record live under
--state-dir/files (each written atomically) and outlast restarts; a state directory that cannot
take them answers 507. A key sees only its own files (another's id: 404, as an unknown one).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, File, Form, Query, Request, UploadFile
from fastapi.responses import Response
from gptserve.server.errors import APIError
from gptserve.server.fine_tuning.manager import FineTuning, fine_tuning_on, tenant_of
from gptserve.server.fine_tuning.schemas import STORAGE_ERRORS, FileDeleted, FileList, FileObject
from gptserve.server.fine_tuning.store import page, public
from gptserve.server.protocol import ERROR_RESPONSES
from gptserve.server.request_fields import refuse_unknown
from gptserve.training.chat_data import ChatDataError, check_chat_file
from starlette.concurrency import run_in_threadpool

router = APIRouter(dependencies=[Depends(fine_tuning_on)], tags=["files"])
PURPOSES = ("fine-tune",)
EXPIRY_SECONDS = (3600, 2_592_000)  # OpenAI's bounds: an hour to 30 days
FORM_FIELDS = ("file", "purpose", "expires_after[anchor]", "expires_after[seconds]")
_BYTES = {"schema": {"type": "string", "format": "binary"}}
_CONTENT = {
    200: {"description": "the file's bytes", "content": {"application/octet-stream": _BYTES}},
    **ERROR_RESPONSES,
}


def _doc(model: type) -> dict[int | str, dict[str, Any]]:
    return {200: {"model": model}, **ERROR_RESPONSES}


def _check(content: bytes) -> None:
    """A 400 unless `content` is chat fine-tuning JSONL (the first bad line named)."""
    try:
        lines = content.decode("utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise APIError(400, f"the file is not UTF-8 text: {exc}", "file", "invalid_file") from None
    try:
        check_chat_file(lines)
    except ChatDataError as exc:
        more = f" ({len(exc.errors)} bad lines)" if len(exc.errors) > 1 else ""
        raise APIError(
            400, f"invalid fine-tuning file: {exc.errors[0]}{more}", "file", "invalid_file"
        ) from None


def _file(request: Request, file_id: str) -> dict:
    ft: FineTuning = request.app.state.fine_tuning
    ft.expire_files()
    record = ft.files.get(file_id, tenant_of(request))
    if record is None:
        raise APIError(404, f"no file {file_id!r}", "file_id", "file_not_found")
    return record


@router.post("/v1/files", response_model=None, responses=_doc(FileObject) | STORAGE_ERRORS)
async def upload_file(
    request: Request,
    file: Annotated[UploadFile, File(description="OpenAI's fine-tuning JSONL (chat)")],
    purpose: Annotated[str, Form(description="'fine-tune' (others: 400)")],
    anchor: Annotated[Literal["created_at"] | None, Form(alias="expires_after[anchor]")] = None,
    seconds: Annotated[
        int | None, Form(alias="expires_after[seconds]", ge=EXPIRY_SECONDS[0], le=EXPIRY_SECONDS[1])
    ] = None,
) -> dict:
    ft: FineTuning = request.app.state.fine_tuning
    form = await request.form()  # parsed once already for the parameters above
    refuse_unknown({k: None for k in form if k not in FORM_FIELDS}, "a file upload")
    if (anchor is None) != (seconds is None):
        missing = "expires_after[seconds]" if seconds is None else "expires_after[anchor]"
        raise APIError(400, f"expires_after needs both anchor and seconds: {missing} is missing",
                       missing)  # fmt: skip
    if purpose not in PURPOSES:
        raise APIError(
            400, f"purpose {purpose!r} is not supported here (only 'fine-tune')", "purpose",
            "invalid_purpose",
        )  # fmt: skip
    limit = ft.settings.max_file_bytes
    content = await file.read(limit + 1)
    if len(content) > limit:
        raise APIError(413, f"the file is larger than {limit} bytes", "file", "file_too_large")
    await run_in_threadpool(_check, content)
    created = int(time.time())
    record = {
        "id": f"file-{uuid.uuid4().hex[:24]}",
        "object": "file",
        "bytes": len(content),
        "created_at": created,
        "filename": file.filename or "upload.jsonl",
        "purpose": purpose,
        "status": "processed",
        "status_details": None,
        "expires_at": None if seconds is None else created + seconds,
        "_owner": tenant_of(request),
        "_seq": time.time_ns(),
    }
    await run_in_threadpool(ft.add_file, record, content)
    return public(record)


@router.get("/v1/files", response_model=None, responses=_doc(FileList))
async def list_files(
    request: Request, purpose: str | None = None, after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10000)] = 10000,
    order: Literal["asc", "desc"] = "desc",
) -> dict:  # fmt: skip
    ft: FineTuning = request.app.state.fine_tuning
    ft.expire_files()
    files = [public(r) for r in ft.files.owned(tenant_of(request))]
    files = [f for f in files if purpose is None or f["purpose"] == purpose]
    return page(files[::-1] if order == "desc" else files, after, limit)


@router.get("/v1/files/{file_id}", response_model=None, responses=_doc(FileObject))
async def retrieve_file(file_id: str, request: Request) -> dict:
    return public(_file(request, file_id))


@router.get(
    "/v1/files/{file_id}/content", response_class=Response, response_model=None,
    responses=_CONTENT,
)  # fmt: skip
async def file_content(file_id: str, request: Request) -> Response:
    ft: FineTuning = request.app.state.fine_tuning
    record = _file(request, file_id)
    try:
        content = await run_in_threadpool(ft.file_path(record["id"]).read_bytes)
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise APIError(503, f"the file's content cannot be read ({reason})",
                       code="storage_error") from None  # fmt: skip
    return Response(content, media_type="application/octet-stream")


@router.delete(
    "/v1/files/{file_id}", response_model=None, responses=_doc(FileDeleted) | STORAGE_ERRORS
)
async def delete_file(file_id: str, request: Request) -> dict:
    ft: FineTuning = request.app.state.fine_tuning
    record = _file(request, file_id)
    await run_in_threadpool(ft.delete_file, record["id"])
    return {"id": record["id"], "object": "file", "deleted": True}
