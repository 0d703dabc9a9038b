"""A state directory that cannot be written fails the job or the upload, never the server: a job
whose output directory cannot be made is `failed` saying why, a disk that fills while a job
trains fails that job, an upload to a full disk is a 507 in OpenAI's shape, and the server goes
on serving (chat, and the next job). Tests run as root in CI, where chmod does not stop a write:
a file where a directory belongs, and OSError(ENOSPC) where the disk would be full, stand in."""

from __future__ import annotations

import errno
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from gptserve.server.settings import Settings

from tests.server.conftest import MODEL_NAME, LiveServer, live_server

DEADLINE = 120.0


def example() -> str:
    return (
        '{"messages": [{"role": "user", "content": "What is the code?"}, '
        '{"role": "assistant", "content": "The code is 42."}]}'
    )


@pytest.fixture()
def live(tiny_checkpoint: Path, tmp_path: Path) -> Iterator[LiveServer]:
    settings = Settings(
        model=str(tiny_checkpoint), enable_fine_tuning=True, state_dir=str(tmp_path / "state")
    )
    with live_server(settings) as server:
        yield server


@pytest.fixture()
def data(tmp_path: Path) -> Path:
    path = tmp_path / "facts.jsonl"
    path.write_text("".join(example() + "\n" for _ in range(8)))
    return path


def client(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key="none", max_retries=0, timeout=30)


def wait_for(c: openai.OpenAI, job_id: str, statuses: tuple[str, ...]):  # noqa: ANN201
    deadline = time.monotonic() + DEADLINE
    while (job := c.fine_tuning.jobs.retrieve(job_id)).status not in statuses:
        assert time.monotonic() < deadline, f"job {job_id} still {job.status}"
        time.sleep(0.1)
    return job


def still_serves(c: openai.OpenAI) -> None:
    reply = c.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
    )
    assert reply.choices[0].message.content is not None
    assert c.fine_tuning.jobs.list().object == "list"


def upload(c: openai.OpenAI, data: Path) -> str:
    with open(data, "rb") as f:
        return c.files.create(file=f, purpose="fine-tune").id


def test_an_unwritable_job_directory_fails_the_job_not_the_server(
    live: LiveServer, data: Path
) -> None:
    c = client(live)
    training = upload(c, data)
    runs = live.app.state.fine_tuning.runs
    runs.parent.mkdir(parents=True, exist_ok=True)
    runs.write_text("a file where the jobs' output directory belongs")
    job = c.fine_tuning.jobs.create(model=MODEL_NAME, training_file=training)
    failed = wait_for(c, job.id, ("failed", "succeeded", "cancelled"))
    assert failed.status == "failed" and failed.error.code == "storage_error", failed.error
    assert failed.error.message == (
        "the server's state directory cannot be written (Not a directory)"
    )
    assert str(runs) not in failed.error.message  # no server path in an answer
    still_serves(c)
    runs.unlink()  # writable again: the worker went on, and the next job trains
    again = c.fine_tuning.jobs.create(
        model=MODEL_NAME, training_file=training, hyperparameters={"n_epochs": 1, "batch_size": 8}
    )
    assert wait_for(c, again.id, ("failed", "succeeded")).status == "succeeded"


def test_a_disk_that_fills_while_a_job_trains_fails_that_job(
    live: LiveServer, data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    c = client(live)
    ft = live.app.state.fine_tuning
    job = c.fine_tuning.jobs.create(  # 400 steps: still training when the disk fills
        model=MODEL_NAME, training_file=upload(c, data),
        hyperparameters={"n_epochs": 50, "batch_size": 1},
    )  # fmt: skip
    wait_for(c, job.id, ("running",))
    saved = ft.jobs.save

    def full(record: dict) -> None:
        ft.jobs.records[record["id"]] = record
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ft.jobs, "save", full)
    failed = wait_for(c, job.id, ("failed", "succeeded", "cancelled"))
    assert failed.status == "failed" and failed.error.code == "insufficient_storage"
    assert "(No space left on device)" in failed.error.message
    monkeypatch.setattr(ft.jobs, "save", saved)
    still_serves(c)


def test_an_upload_to_a_full_disk_is_a_507(
    live: LiveServer, data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    c = client(live)

    def full(path: Path, content: bytes) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("gptserve.server.fine_tuning.manager.write_atomic", full)
    with pytest.raises(openai.APIStatusError) as caught:
        upload(c, data)
    assert caught.value.status_code == 507
    error = caught.value.body
    assert error["code"] == "insufficient_storage" and error["type"] == "server_error"
    assert error["message"] == (
        "cannot store the file: the server's state directory cannot be written "
        "(No space left on device)"
    )
    assert c.files.list().data == []  # nothing half kept
    monkeypatch.undo()
    contents = live.app.state.fine_tuning.contents
    contents.rmdir()
    contents.write_text("a file where the uploads' directory belongs")
    with pytest.raises(openai.APIStatusError) as caught:
        upload(c, data)
    assert caught.value.status_code == 507 and caught.value.body["code"] == "storage_error"
    assert c.files.list().data == []
    still_serves(c)
    contents.unlink()
    contents.mkdir()
    assert upload(c, data) in [f.id for f in c.files.list()]


def test_a_state_directory_that_cannot_be_made_fails_uploads_not_the_start(
    tiny_checkpoint: Path, tmp_path: Path, data: Path
) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    settings = Settings(
        model=str(tiny_checkpoint), enable_fine_tuning=True, state_dir=str(blocked / "state")
    )
    with live_server(settings) as server:
        c = client(server)
        with pytest.raises(openai.APIStatusError) as caught:
            upload(c, data)
        assert caught.value.status_code == 507 and caught.value.body["code"] == "storage_error"
        assert c.files.list().data == []
        still_serves(c)
