"""The fine-tuning state of one server: files, jobs, the queue, and the models they made.

`FineTuning(settings, server_state)` reloads what --state-dir holds; `run()` (an asyncio task of
the app's lifespan) waits for the model to serve, loads the fine-tuned adapters of the jobs that
succeeded into the LoRA slots, then runs the queued jobs one at a time, each in a subprocess
(runner). A job that was running when the server stopped (killed, or shut down) resumes from
its run's last checkpoint (train_state.pt: written once an epoch, atomically) when it has one, and
is failed (`server_restarted`, saying why) when it has none; a queued one stays queued. A state
directory that cannot be written (a full disk, read-only) fails the job it happens to
(`insufficient_storage` or `storage_error`) and answers an upload 507; the server goes on. Job
status: validating_files -> queued -> running -> succeeded | failed | cancelled (a resumed job:
running -> queued at the restart). A job that succeeds is served at once as
`ft:<base>:<suffix>:<job id>` (without a suffix `ft:<base>:<job id>`), for its owner only
(ServerState.model_owners).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import time
import uuid
from pathlib import Path
from typing import Any

from fastapi import Request
from gptserve.engine.adapters import AdapterError, read_adapter
from gptserve.server.errors import APIError
from gptserve.server.fine_tuning import recipe
from gptserve.server.fine_tuning.runner import TrainingProcess
from gptserve.server.fine_tuning.store import RecordStore, make_directory, write_atomic
from gptserve.server.runtime import ServerState
from gptserve.server.settings import Settings
from gptserve.server.tenancy import TENANT_SCOPE_KEY
from gptserve.training.chat_data import ChatDataError, check_chat_file
from gptserve.training.checkpointing import STATE_FILE, read_train_state
from gptserve.training.errors import TrainError

log = logging.getLogger(__name__)
FINISHED = ("succeeded", "failed", "cancelled")
POLL_SECONDS = 0.25


def tenant_of(request: Request) -> str | None:
    return request.scope.get(TENANT_SCOPE_KEY)


async def fine_tuning_on(request: Request) -> None:
    """404 unless the server runs with --enable-fine-tuning."""
    if getattr(request.app.state, "fine_tuning", None) is None:
        raise APIError(
            404, "fine-tuning is off (start the server with --enable-fine-tuning)",
            code="not_found",
        )  # fmt: skip


def storage_code(exc: OSError) -> str:
    """The error code of a state directory that cannot be written."""
    return "insufficient_storage" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else "storage_error"


def storage_error(exc: OSError, what: str) -> APIError:
    """A 507 for a write to the state directory that failed (the reason, not the path)."""
    reason = exc.strerror or type(exc).__name__
    message = f"cannot {what}: the server's state directory cannot be written ({reason})"
    return APIError(507, message, code=storage_code(exc))


def event(message: str, kind: str = "message", data: dict | None = None, level: str = "info"):  # noqa: ANN201
    return {
        "id": f"ftevent-{uuid.uuid4().hex[:24]}", "object": "fine_tuning.job.event",
        "created_at": int(time.time()), "level": level, "message": message, "data": data,
        "type": kind,
    }  # fmt: skip


class FineTuning:
    def __init__(self, settings: Settings, state: ServerState) -> None:
        self.settings = settings
        self.state = state
        root = settings.fine_tuning_dir
        self.files = RecordStore(root / "files")
        self.contents = root / "files" / "content"
        make_directory(self.contents)
        self.jobs = RecordStore(root / "jobs")
        self.runs = root / "jobs" / "runs"
        self._wake: asyncio.Event | None = None
        for job in list(self.jobs.records.values()):
            if job["status"] == "running":
                self._after_a_stop(job)
            elif job["status"] == "validating_files":
                job["status"] = "queued"
                self._save(job)

    def _after_a_stop(self, job: dict[str, Any]) -> None:
        """A job the server stopped while it ran: queued again to resume from its checkpoint, or
        failed when it has none (or an unreadable one)."""
        stopped, run = "the server stopped while the job ran", self.runs / job["id"]
        try:
            if not (run / STATE_FILE).is_file():
                raise FileNotFoundError
            step = int(read_train_state(run, mmap=True)["step"])
        except (TrainError, KeyError, TypeError, ValueError, OSError) as exc:
            why = (
                "before its first checkpoint"
                if isinstance(exc, FileNotFoundError)
                else "and its checkpoint cannot be read"
            )
            self._finish(job, "failed", "server_restarted", f"{stopped}, {why}; create it again")
            return
        job["status"] = "queued"
        job["_events"].append(event(f"{stopped}; it resumes from its checkpoint at step {step}"))
        self._save(job)

    def _save(self, job: dict[str, Any]) -> None:
        """Save `job`, or log why not (its state in memory stands; it is what the API answers)."""
        try:
            self.jobs.save(job)
        except OSError as exc:
            log.warning("cannot save fine-tuning job %s: %s", job["id"], exc)

    # files
    def file_path(self, file_id: str) -> Path:
        return self.contents / f"{file_id}.jsonl"

    def add_file(self, record: dict[str, Any], content: bytes) -> None:
        """Store an upload (content first, then its record, each atomically); a 507 when the
        state directory cannot take it (nothing is kept then)."""
        try:
            write_atomic(self.file_path(record["id"]), content)
            self.files.save(record)
        except OSError as exc:
            self.files.records.pop(record["id"], None)
            with contextlib.suppress(OSError):
                self.file_path(record["id"]).unlink(missing_ok=True)
            raise storage_error(exc, "store the file") from None

    def delete_file(self, file_id: str) -> None:
        try:
            self.file_path(file_id).unlink(missing_ok=True)
            self.files.delete(file_id)
        except OSError as exc:
            raise storage_error(exc, "delete the file") from None

    def expire_files(self) -> None:
        """Delete the files whose `expires_at` (files.create's `expires_after`) has passed."""
        now = time.time()
        for record in list(self.files.records.values()):
            if record.get("expires_at") is not None and record["expires_at"] <= now:
                try:
                    self.delete_file(record["id"])
                except APIError as exc:
                    log.warning("cannot delete the expired file %s: %s", record["id"], exc)

    # jobs
    def add_job(self, job: dict[str, Any]) -> None:
        job["_events"] = [event(f"Created fine-tuning job: {job['id']}")]
        job["status"] = "queued"
        try:
            self.jobs.save(job)
        except OSError as exc:
            self.jobs.records.pop(job["id"], None)
            raise storage_error(exc, "create the job") from None
        if self._wake is not None:
            self._wake.set()

    def cancel(self, job: dict[str, Any]) -> None:
        if job["status"] in FINISHED:
            raise APIError(
                400, f"the job is already {job['status']}", "fine_tuning_job_id", "invalid_state"
            )
        self._finish(job, "cancelled", None, None)  # a running job's process ends in run()

    def _finish(self, job: dict, status: str, code: str | None, message: str | None) -> None:
        job["status"] = status
        job["finished_at"] = int(time.time())
        if code is not None:
            job["error"] = {"code": code, "message": message, "param": None}
            job["_events"].append(event(f"The job failed: {message}", level="error"))
        elif status == "cancelled":
            job["_events"].append(event("The job was cancelled"))
        self._save(job)

    async def run(self) -> None:
        """The worker: loads the finished jobs' models once the engine serves, then runs jobs."""
        self._wake = asyncio.Event()
        while not self.state.ready:
            if self.state.load_error or self.state.closed:
                return
            await asyncio.sleep(0.1)
        for job in list(self.jobs.records.values()):
            if job["status"] == "succeeded" and job.get("fine_tuned_model"):
                try:
                    await self._serve(job)
                except Exception as exc:  # noqa: BLE001 - one bad adapter must not stop the rest
                    log.warning("could not serve %s again: %s", job["fine_tuned_model"], exc)
        while True:
            queued = [j for j in self.jobs.records.values() if j["status"] == "queued"]
            if not queued:
                self._wake.clear()
                await self._wake.wait()
                continue
            job = queued[0]
            try:
                await self._run_job(job)
            except asyncio.CancelledError:
                raise
            except OSError as exc:  # the state directory: this job fails, the worker goes on
                log.warning("fine-tuning job %s failed: %s", job["id"], exc)
                if job["status"] not in FINISHED:
                    reason = exc.strerror or type(exc).__name__
                    message = f"the server's state directory cannot be written ({reason})"
                    self._finish(job, "failed", storage_code(exc), message)
            except Exception as exc:  # noqa: BLE001 - the job fails, the worker goes on
                log.exception("fine-tuning job %s failed", job["id"])
                if job["status"] not in FINISHED:
                    self._finish(job, "failed", "internal_error", str(exc) or repr(exc))

    async def _serve(self, job: dict[str, Any]) -> None:
        """Load the job's adapter into a LoRA slot and name it for its owner."""
        name, out = job["fine_tuned_model"], self.runs / job["id"]
        config = self.state.loaded.model.config
        adapter = await asyncio.to_thread(read_adapter, out, config, name)
        async_engine = self.state.require_ready()
        await async_engine.run_on_engine(lambda engine: engine.adapters.load(name, adapter))
        self.state.model_owners[name] = job["_owner"]
        self.state.lora_names[name] = str(out)

    async def _run_job(self, job: dict[str, Any]) -> None:
        job["status"] = "validating_files"
        self.jobs.save(job)
        data = self.file_path(job["training_file"])
        val = self.file_path(job["validation_file"]) if job["validation_file"] else None
        try:
            examples = len(await asyncio.to_thread(check_chat_file, data))
            if val is not None:
                await asyncio.to_thread(check_chat_file, val)
        except (ChatDataError, OSError) as exc:
            self._finish(job, "failed", "invalid_training_file", _hide(str(exc), job, data, val))
            return
        if job["status"] == "cancelled":
            return
        hyper = recipe.resolve(job["hyperparameters"], examples)
        steps, per_epoch = recipe.total_steps(hyper, examples, self.settings.fine_tune_max_steps)
        job["hyperparameters"] = hyper
        job["method"] = {"type": "supervised", "supervised": {"hyperparameters": hyper}}
        out = self.runs / job["id"]
        resume = (out / STATE_FILE).is_file()  # this job's own run, stopped with the server
        threads = self.settings.fine_tune_threads
        argv = recipe.train_argv(
            self.state.loaded.path, data, val, out, hyper, steps, per_epoch, job["seed"], threads,
            resume,
        )  # fmt: skip
        reported = (job["_metrics"] or {}).get("step", 0) if resume else 0
        # started from the event loop's thread, which lives as long as the server: the process's
        # parent-death signal (runner) is tied to the thread that starts it
        process = TrainingProcess(argv, out, threads, after_step=reported)
        try:
            if job["status"] != "validating_files":  # cancelled meanwhile
                return
            job["status"] = "running"
            started = "resumed from its checkpoint" if resume else "started"
            job["_events"].append(event(f"Fine-tuning job {started}"))
            if steps < per_epoch * hyper["n_epochs"]:
                job["_events"].append(
                    event(f"Training stops after {steps} steps (--fine-tune-max-steps)")
                )
            self.jobs.save(job)
            tokens = await asyncio.to_thread(_tokens_an_example, self.state, data)
            while (code := process.poll()) is None and job["status"] == "running":
                self._metrics(job, process, steps, tokens * hyper["batch_size"])
                await asyncio.sleep(POLL_SECONDS)
            if job["status"] != "running":
                return
            self._metrics(job, process, steps, tokens * hyper["batch_size"])
        finally:
            if process.poll() is None:  # cancelled, failed, or the server stops
                await asyncio.to_thread(process.stop)
        if code != 0:
            message = _hide(process.failure(), job, data, val)
            self._finish(job, "failed", "training_failed", message)
            return
        suffix = f"{job['suffix']}:" if job.get("suffix") else ""
        job["fine_tuned_model"] = f"ft:{job['model']}:{suffix}{job['id']}"
        try:
            await self._serve(job)
        except (AdapterError, ValueError, APIError) as exc:
            job["fine_tuned_model"] = None
            message = getattr(exc, "message", None) or str(exc)
            self._finish(
                job,
                "failed",
                "adapter_not_served",
                f"the adapter was trained but could not be served: {message}",
            )
            return
        last = job["_metrics"] or {}
        job["_checkpoints"] = [{
            "id": f"ftckpt-{job['id'][len('ftjob-'):]}", "object": "fine_tuning.job.checkpoint",
            "created_at": int(time.time()), "fine_tuned_model_checkpoint": job["fine_tuned_model"],
            "fine_tuning_job_id": job["id"], "step_number": last.get("step", steps),
            "metrics": {k: last[k] for k in ("step", "train_loss", "valid_loss") if k in last},
        }]  # fmt: skip
        job["_events"].append(event(f"New fine-tuned model created: {job['fine_tuned_model']}"))
        job["_events"].append(event("The job has successfully completed"))
        self._finish(job, "succeeded", None, None)

    def _metrics(self, job: dict, process: TrainingProcess, steps: int, step_tokens: int) -> None:
        rows = process.new_metrics()
        for row in rows:
            data = {"step": row["step"], "train_loss": row["train_loss"], "total_steps": steps}
            message = f"Step {row['step']}/{steps}: training loss={row['train_loss']:.4f}"
            if "val_loss" in row:
                data["valid_loss"] = row["val_loss"]
                message += f", validation loss={row['val_loss']:.4f}"
            job["_events"].append(event(message, "metrics", data))
            job["_metrics"] = data
            job["trained_tokens"] = row["step"] * step_tokens
        if rows:
            self.jobs.save(job)


def _hide(message: str, job: dict, data: Path, val: Path | None) -> str:
    """A training error without the server's paths: the files named by their ids."""
    message = message.replace(str(data), job["training_file"])
    if val is not None:
        message = message.replace(str(val), job["validation_file"])
    return message


def _tokens_an_example(state: ServerState, data: Path) -> int:
    """About how many tokens an example of `data` has (its messages' text, tokenized): what
    `trained_tokens` counts a step as, times the batch size."""
    try:
        examples = check_chat_file(data)
    except (ChatDataError, OSError):
        return 0
    texts = [str(m.get("content") or "") for ex in examples for m in ex.messages]
    total = len(state.loaded.tokenizer.encode("\n".join(texts)))
    return max(1, round(total / max(1, len(examples))))
