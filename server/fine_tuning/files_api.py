"""OpenAI's /v1/files for fine-tuning data: upload, list, retrieve, content, delete.

Only `purpose: "fine-tune"` is taken (others: 400). An upload is at most --max-file-bytes (413
above), UTF-8 JSONL that training.chat_data.check_chat_file accepts (structure only: the
template and token checks run when a job starts); a bad file is a 400 naming its first bad line.
The file and its record live under --state-dir/files and outlast restarts. A key sees only its
own files (another's id: 404, as an unknown one).
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated

from fastapi import APIRouter, Depends, File, Form, Request, UploadFile
from fastapi.responses import Response
from gptserve.server.errors import APIError
from gptserve.server.fine_tuning.manager import FineTuning, fine_tuning_on, tenant_of
from gptserve.server.fine_tuning.store import page, public
from gptserve.training.chat_data import ChatDataError, check_chat_file
from starlette.concurrency import run_in_threadpool

# out of /openapi.json for now: it has no response models yet, and tests/server/test_fuzz.py fuzzes
# every operation the schema lists
router = APIRouter(dependencies=[Depends(fine_tuning_on)], include_in_schema=False)
PURPOSES = ("fine-tune",)


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
    record = ft.files.get(file_id, tenant_of(request))
    if record is None:
        raise APIError(404, f"no file {file_id!r}", "file_id", "file_not_found")
    return record


@router.post("/v1/files")
async def upload_file(
    request: Request, file: Annotated[UploadFile, File()], purpose: Annotated[str, Form()]
) -> dict:
    ft: FineTuning = request.app.state.fine_tuning
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
    record = {
        "id": f"file-{uuid.uuid4().hex[:24]}",
        "object": "file",
        "bytes": len(content),
        "created_at": int(time.time()),
        "filename": file.filename or "upload.jsonl",
        "purpose": purpose,
        "status": "processed",
        "status_details": None,
        "expires_at": None,
        "_owner": tenant_of(request),
        "_seq": time.time_ns(),
    }
    await run_in_threadpool(ft.add_file, record, content)
    return public(record)


@router.get("/v1/files")
async def list_files(
    request: Request, purpose: str | None = None, after: str | None = None, limit: int = 10000,
    order: str = "desc",
) -> dict:  # fmt: skip
    ft: FineTuning = request.app.state.fine_tuning
    files = [public(r) for r in ft.files.owned(tenant_of(request))]
    files = [f for f in files if purpose is None or f["purpose"] == purpose]
    return page(files[::-1] if order == "desc" else files, after, max(1, limit))


@router.get("/v1/files/{file_id}")
async def retrieve_file(file_id: str, request: Request) -> dict:
    return public(_file(request, file_id))


@router.get("/v1/files/{file_id}/content")
async def file_content(file_id: str, request: Request) -> Response:
    ft: FineTuning = request.app.state.fine_tuning
    record = _file(request, file_id)
    content = await run_in_threadpool(ft.file_path(record["id"]).read_bytes)
    return Response(content, media_type="application/octet-stream")


@router.delete("/v1/files/{file_id}")
async def delete_file(file_id: str, request: Request) -> dict:
    ft: FineTuning = request.app.state.fine_tuning
    record = _file(request, file_id)
    await run_in_threadpool(ft.delete_file, record["id"])
    return {"id": record["id"], "object": "file", "deleted": True}
