"""A server killed (SIGKILL) while a fine-tuning job trains loses nothing: a real `gptserve serve`
(the default model) is killed mid-job, its training process dies with it (no orphan writes on
into --state-dir), and the server restarted on the same --state-dir has every file and finished
model, and resumes the killed job from its last checkpoint to `succeeded`. A job killed before
its first checkpoint is failed saying why (checked on the records, without a model)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import openai
import psutil
import pytest
import torch
from gptserve.model.known_models import DEFAULT_MODEL_NAME, cache_dir, fetch_known_model
from gptserve.server.fine_tuning.manager import FineTuning
from gptserve.server.fine_tuning.store import RecordStore
from gptserve.server.settings import Settings
from gptserve.training.checkpointing import STATE_FILE

from tests.server.conftest import free_port, wait_for_server

REPO = Path(__file__).resolve().parents[2]
DEADLINE = 600.0  # seconds for a job of a few steps of the default model on a busy 2-core CPU


def example(answer: str) -> str:
    return json.dumps({
        "messages": [{"role": "user", "content": "What is the code?"},
                     {"role": "assistant", "content": answer}]
    })  # fmt: skip


@contextmanager
def serve(state_dir: Path, log: Path) -> Iterator[tuple[subprocess.Popen, openai.OpenAI]]:
    """`python -m gptserve.server` (the default model) with fine-tuning on `state_dir`."""
    port = free_port()
    argv = [sys.executable, "-m", "gptserve.server", "--host", "127.0.0.1", "--port", str(port),
            "--enable-fine-tuning", "--state-dir", str(state_dir)]  # fmt: skip
    env = {**os.environ, "GPTSERVE_CACHE": str(cache_dir())}
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        wait_for_server(f"http://127.0.0.1:{port}", proc, timeout=300)
        url = f"http://127.0.0.1:{port}/v1"
        yield proc, openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(60)


def wait_job(c: openai.OpenAI, job_id: str, statuses: tuple[str, ...]):  # noqa: ANN201
    deadline = time.monotonic() + DEADLINE
    while (job := c.fine_tuning.jobs.retrieve(job_id)).status not in statuses:
        assert time.monotonic() < deadline, f"job {job_id} still {job.status}"
        time.sleep(0.5)
    return job


def is_gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # dead, not yet reaped
    except psutil.NoSuchProcess:
        return True


def test_a_server_killed_mid_job_loses_nothing_and_the_job_resumes(tmp_path: Path) -> None:
    fetch_known_model(DEFAULT_MODEL_NAME)  # into the cache the server reads (a failure names why)
    state, log = tmp_path / "state", tmp_path / "server.log"
    data = tmp_path / "facts.jsonl"
    data.write_text(example("The code is 42.") + "\n" + example("It is 42.") + "\n")
    with serve(state, log) as (proc, c):
        with open(data, "rb") as f:
            training = c.files.create(file=f, purpose="fine-tune")
        done = c.fine_tuning.jobs.create(  # one step: both examples in one batch, one epoch
            model=DEFAULT_MODEL_NAME, training_file=training.id,
            hyperparameters={"n_epochs": 1, "batch_size": 2},
        )  # fmt: skip
        model = wait_job(c, done.id, ("succeeded", "failed")).fine_tuned_model
        assert model is not None, c.fine_tuning.jobs.retrieve(done.id).error
        killed = c.fine_tuning.jobs.create(  # 8 steps; a checkpoint every epoch (2 steps)
            model=DEFAULT_MODEL_NAME, training_file=training.id,
            hyperparameters={"n_epochs": 4, "batch_size": 1},
        )  # fmt: skip
        checkpoint = state / "jobs" / "runs" / killed.id / STATE_FILE
        deadline = time.monotonic() + DEADLINE
        while not checkpoint.is_file():
            assert time.monotonic() < deadline, "no checkpoint was written"
            time.sleep(0.1)
        trainers = [p for p in psutil.Process(proc.pid).children() if "gptserve.training" in
                    " ".join(p.cmdline())]  # fmt: skip
        assert len(trainers) == 1, trainers
        assert c.fine_tuning.jobs.retrieve(killed.id).status == "running"
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        deadline = time.monotonic() + 10
        while not is_gone(trainers[0].pid):  # the kernel's parent-death signal ends it
            assert time.monotonic() < deadline, "the training process outlived the server"
            time.sleep(0.05)
    saved_at = torch.load(checkpoint, map_location="cpu", weights_only=True, mmap=True)["step"]
    assert 2 <= saved_at < 8
    with serve(state, log) as (_, c):
        assert [f.id for f in c.files.list()] == [training.id]
        assert c.files.content(training.id).content == data.read_bytes()
        assert c.fine_tuning.jobs.retrieve(done.id).fine_tuned_model == model
        deadline = time.monotonic() + 60
        while model not in [m.id for m in c.models.list()]:  # loaded once the engine serves
            assert time.monotonic() < deadline, "the finished model is not served again"
            time.sleep(0.2)
        reply = c.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "What is the code?"}],
            max_tokens=4, temperature=0,
        )  # fmt: skip
        assert reply.model == model and reply.choices[0].message.content
        resumed = wait_job(c, killed.id, ("succeeded", "failed", "cancelled"))
        assert resumed.status == "succeeded", resumed.error
        events = [e.message for e in c.fine_tuning.jobs.list_events(killed.id, limit=100)]
        assert (
            "the server stopped while the job ran; it resumes from its checkpoint at step "
            f"{saved_at}" in events
        )
        assert "Fine-tuning job resumed from its checkpoint" in events
        steps = [e.data["step"] for e in c.fine_tuning.jobs.list_events(killed.id, limit=100)
                 if e.type == "metrics"]  # fmt: skip
        assert max(steps) == 8 and len(steps) == len(set(steps))  # no step reported twice
        assert resumed.fine_tuned_model in [m.id for m in c.models.list()]


def running_job(jobs: RecordStore, job_id: str) -> None:
    jobs.save({
        "id": job_id, "object": "fine_tuning.job", "status": "running", "created_at": 1,
        "finished_at": None, "error": None, "_owner": None, "_seq": 1, "_events": [],
    })  # fmt: skip


def test_a_job_stopped_without_a_usable_checkpoint_fails_saying_why(tmp_path: Path) -> None:
    """At start, a job the server stopped while it ran: resumed when its run has a checkpoint,
    failed (`server_restarted`, why in the message) when it has none or an unreadable one."""
    jobs = RecordStore(tmp_path / "jobs")
    for job_id in ("ftjob-none", "ftjob-corrupt", "ftjob-saved"):
        running_job(jobs, job_id)
    runs = tmp_path / "jobs" / "runs"
    (runs / "ftjob-corrupt").mkdir(parents=True)
    (runs / "ftjob-corrupt" / STATE_FILE).write_bytes(b"cut short by a crash")
    (runs / "ftjob-saved").mkdir()
    torch.save({"step": 4, "model": {}}, runs / "ftjob-saved" / STATE_FILE)
    ft = FineTuning(Settings(state_dir=str(tmp_path)), SimpleNamespace())
    none, corrupt, saved = (
        ft.jobs.records[i] for i in ("ftjob-none", "ftjob-corrupt", "ftjob-saved")
    )
    assert none["status"] == "failed" and none["error"]["code"] == "server_restarted"
    assert (
        "the server stopped while the job ran, before its first checkpoint"
        in none["error"]["message"]
    )
    assert (
        corrupt["status"] == "failed" and "checkpoint cannot be read" in corrupt["error"]["message"]
    )
    assert saved["status"] == "queued" and saved["error"] is None
    assert "resumes from its checkpoint at step 4" in saved["_events"][-1]["message"]
    again = RecordStore(tmp_path / "jobs")  # and so they were saved
    assert [again.records[i]["status"] for i in ("ftjob-none", "ftjob-corrupt", "ftjob-saved")] == [
        "failed",
        "failed",
        "queued",
    ]


def test_a_record_write_is_all_or_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A write that fails midway (a full disk) leaves the record as last saved, and no temporary
    file that a restart would read."""
    store = RecordStore(tmp_path)
    store.save({"id": "file-1", "created_at": 1, "bytes": 10})

    def full(fd: int) -> None:  # the data did not fit: the disk says so when it is flushed
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError):
        store.save({"id": "file-1", "created_at": 1, "bytes": 20})
    monkeypatch.undo()
    assert RecordStore(tmp_path).records["file-1"]["bytes"] == 10
    assert [p.name for p in tmp_path.iterdir()] == ["file-1.json"]


@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's"
)
def test_a_training_process_dies_with_its_server(tmp_path: Path) -> None:
    """A stand-in server (a Python process) starts a TrainingProcess and is SIGKILLed: its child
    ends too, rather than living on as an orphan."""
    server = (
        "import sys, time; from pathlib import Path\n"
        "from gptserve.server.fine_tuning.runner import TrainingProcess\n"
        "child = TrainingProcess([sys.executable, '-c', 'import time; time.sleep(120)'], "
        "Path(sys.argv[1]), threads=1)\n"
        "print(child.proc.pid, flush=True); time.sleep(120)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", server, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        child = int(proc.stdout.readline())
        assert not is_gone(child)
    finally:
        proc.kill()
        proc.wait(30)
    deadline = time.monotonic() + 10
    while not is_gone(child):
        assert time.monotonic() < deadline, "the training process outlived its server"
        time.sleep(0.05)
