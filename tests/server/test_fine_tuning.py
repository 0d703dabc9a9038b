"""OpenAI's files and fine-tuning jobs (server.fine_tuning) driven by the real `openai` client
against live servers over the tiny checkpoint: uploads checked at the door, a job trained in a
subprocess (a few steps: --fine-tune-max-steps) and served at once as ft:..., cancelling, each
key seeing only its own, and everything back after a restart on the same --state-dir."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import openai
import pytest
from gptserve.server.settings import Settings
from gptserve.training.checkpointing import STATE_FILE

from tests.server.conftest import MODEL_NAME, LiveServer, live_server

USER, OTHER, ADMIN = "ft-user-key", "ft-other-key", "ft-admin-key"
JOB_DEADLINE = 120.0  # seconds; a job of 3 steps on the tiny model takes a few


def example(answer: str = "The code is 42.") -> str:
    return json.dumps({
        "messages": [{"role": "user", "content": "What is the code?"},
                     {"role": "assistant", "content": answer}]
    })  # fmt: skip


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ft-state")


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ft-data") / "facts.jsonl"
    path.write_text("".join(example() + "\n" for _ in range(8)))
    return path


@contextmanager
def serving(checkpoint: Path, state_dir: Path, max_steps: int | None = 3) -> Iterator[LiveServer]:
    settings = Settings(
        model=str(checkpoint), api_keys=[USER, OTHER], admin_api_keys=[ADMIN],
        enable_fine_tuning=True, state_dir=str(state_dir), fine_tune_max_steps=max_steps,
    )  # fmt: skip
    with live_server(settings) as live:
        yield live


@pytest.fixture(scope="module")
def live(tiny_checkpoint: Path, state_dir: Path) -> Iterator[LiveServer]:
    with serving(tiny_checkpoint, state_dir) as server:
        yield server


def client(live: LiveServer, key: str = USER) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key=key, max_retries=0, timeout=30)


def wait_for(c: openai.OpenAI, job_id: str, statuses: tuple[str, ...]):  # noqa: ANN201
    deadline = time.monotonic() + JOB_DEADLINE
    while True:
        job = c.fine_tuning.jobs.retrieve(job_id)
        if job.status in statuses:
            return job
        assert time.monotonic() < deadline, f"job {job_id} still {job.status}"
        time.sleep(0.2)


def test_files_upload_list_retrieve_content_delete(live: LiveServer, data: Path) -> None:
    c = client(live)
    with open(data, "rb") as f:
        uploaded = c.files.create(file=f, purpose="fine-tune")
    assert uploaded.id.startswith("file-") and uploaded.object == "file"
    assert uploaded.bytes == data.stat().st_size and uploaded.filename == "facts.jsonl"
    assert uploaded.purpose == "fine-tune" and uploaded.status == "processed"
    assert uploaded.id in [f.id for f in c.files.list()]
    assert c.files.retrieve(uploaded.id).bytes == uploaded.bytes
    assert c.files.content(uploaded.id).content == data.read_bytes()
    with pytest.raises(openai.NotFoundError):  # another key: as if it did not exist
        client(live, OTHER).files.retrieve(uploaded.id)
    assert uploaded.id not in [f.id for f in client(live, OTHER).files.list()]
    deleted = c.files.delete(uploaded.id)
    assert deleted.id == uploaded.id and deleted.deleted is True
    with pytest.raises(openai.NotFoundError):
        c.files.retrieve(uploaded.id)


def test_a_bad_file_is_refused_naming_its_first_bad_line(live: LiveServer, tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    user_only = json.dumps({"messages": [{"role": "user", "content": "Hi"}]})
    bad.write_text(f"{example()}\n{example()}\n{user_only}\nnot json\n")
    with pytest.raises(openai.BadRequestError) as caught, open(bad, "rb") as f:
        client(live).files.create(file=f, purpose="fine-tune")
    message = caught.value.body["message"]
    assert "line 3: " in message and "line 4" not in message.split("(")[0], message
    with pytest.raises(openai.BadRequestError), open(bad, "rb") as f:
        client(live).files.create(file=f, purpose="assistants")


def test_a_job_trains_and_its_model_serves_at_once(live: LiveServer, data: Path) -> None:
    c = client(live)
    with open(data, "rb") as f:
        training = c.files.create(file=f, purpose="fine-tune")
    job = c.fine_tuning.jobs.create(
        model=MODEL_NAME, training_file=training.id, validation_file=training.id, suffix="facts",
        seed=7, hyperparameters={"n_epochs": 2, "batch_size": 2, "learning_rate_multiplier": "auto"},
    )  # fmt: skip
    assert job.id.startswith("ftjob-") and job.object == "fine_tuning.job"
    assert job.status in ("validating_files", "queued", "running") and job.seed == 7
    done = wait_for(c, job.id, ("succeeded", "failed", "cancelled"))
    assert done.status == "succeeded", done.error
    assert done.fine_tuned_model == f"ft:{MODEL_NAME}:facts:{job.id}"
    assert done.finished_at is not None and done.error is None and done.trained_tokens > 0
    assert done.hyperparameters.n_epochs == 2 and done.hyperparameters.batch_size == 2
    events = list(c.fine_tuning.jobs.list_events(job.id, limit=100))
    metrics = [e for e in events if e.type == "metrics"]
    assert metrics and metrics[0].data["step"] == 3 and "train_loss" in metrics[0].data
    assert "valid_loss" in metrics[0].data  # the last step evaluates the validation file
    assert any("--fine-tune-max-steps" in e.message for e in events)  # 8 steps asked, 3 run
    assert any("successfully completed" in e.message for e in events)
    checkpoints = list(c.fine_tuning.jobs.checkpoints.list(job.id))
    assert [k.fine_tuned_model_checkpoint for k in checkpoints] == [done.fine_tuned_model]
    assert job.id in [j.id for j in c.fine_tuning.jobs.list()]
    # served at once, to its owner only
    assert done.fine_tuned_model in [m.id for m in c.models.list()]
    reply = c.chat.completions.create(
        model=done.fine_tuned_model, messages=[{"role": "user", "content": "What is the code?"}],
        max_tokens=4, temperature=0,
    )  # fmt: skip
    assert reply.model == done.fine_tuned_model and reply.choices[0].message.content is not None
    other = client(live, OTHER)
    assert done.fine_tuned_model not in [m.id for m in other.models.list()]
    with pytest.raises(openai.NotFoundError):
        other.chat.completions.create(
            model=done.fine_tuned_model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
        )
    with pytest.raises(openai.NotFoundError):
        other.fine_tuning.jobs.retrieve(job.id)
    assert job.id not in [j.id for j in other.fine_tuning.jobs.list()]
    with pytest.raises(openai.BadRequestError):  # another key's file is no file of its
        other.fine_tuning.jobs.create(model=MODEL_NAME, training_file=training.id)


def test_cancel_a_job_another_key_cannot(live: LiveServer, data: Path) -> None:
    c = client(live)
    with open(data, "rb") as f:
        training = c.files.create(file=f, purpose="fine-tune")
    job = c.fine_tuning.jobs.create(model=MODEL_NAME, training_file=training.id)
    with pytest.raises(openai.NotFoundError):
        client(live, OTHER).fine_tuning.jobs.cancel(job.id)
    assert c.fine_tuning.jobs.cancel(job.id).status == "cancelled"
    time.sleep(1.0)  # the worker must not bring it back
    assert c.fine_tuning.jobs.retrieve(job.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError):
        c.fine_tuning.jobs.cancel(job.id)
    # an admin key may cancel anyone's job
    other = c.fine_tuning.jobs.create(model=MODEL_NAME, training_file=training.id)
    assert client(live, ADMIN).fine_tuning.jobs.cancel(other.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError):
        c.fine_tuning.jobs.create(model="gpt-4o", training_file=training.id)


def test_files_jobs_and_models_outlast_a_restart(
    tiny_checkpoint: Path, data: Path, tmp_path: Path
) -> None:
    """One server makes a file, a job that succeeds and one still running when it stops; the
    next, on the same --state-dir, has them all, serves the model, and resumes the second from
    its checkpoint if it had written one (once an epoch), else marks it failed saying why.
    (Each branch on its own, and a SIGKILL: tests/server/test_fine_tuning_crash.py.)"""
    with serving(tiny_checkpoint, tmp_path, max_steps=None) as first:
        c = client(first)
        with open(data, "rb") as f:
            training = c.files.create(file=f, purpose="fine-tune")
        done = c.fine_tuning.jobs.create(  # one step: 8 examples a batch, one epoch
            model=MODEL_NAME, training_file=training.id,
            hyperparameters={"n_epochs": 1, "batch_size": 8},
        )  # fmt: skip
        long = c.fine_tuning.jobs.create(  # 400 steps: still running when the server stops
            model=MODEL_NAME, training_file=training.id,
            hyperparameters={"n_epochs": 50, "batch_size": 1},
        )  # fmt: skip
        model = wait_for(c, done.id, ("succeeded",)).fine_tuned_model
        wait_for(c, long.id, ("running",))
    checkpointed = (tmp_path / "jobs" / "runs" / long.id / STATE_FILE).is_file()
    with serving(tiny_checkpoint, tmp_path) as again:
        c = client(again)
        assert [f.id for f in c.files.list()] == [training.id]
        assert [j.id for j in c.fine_tuning.jobs.list()] == [long.id, done.id]  # newest first
        assert c.fine_tuning.jobs.retrieve(done.id).fine_tuned_model == model
        if checkpointed:  # at or past --fine-tune-max-steps (3) already: nothing left to train
            stopped = wait_for(c, long.id, ("succeeded", "failed", "cancelled"))
            assert stopped.status == "succeeded", stopped.error
        else:
            stopped = c.fine_tuning.jobs.retrieve(long.id)
            assert stopped.status == "failed" and stopped.error.code == "server_restarted"
            assert "before its first checkpoint" in stopped.error.message
        deadline = time.monotonic() + 30
        while model not in [m.id for m in c.models.list()]:  # loaded once the engine serves
            assert time.monotonic() < deadline
            time.sleep(0.1)
        reply = c.completions.create(model=model, prompt="The code", max_tokens=3)
        assert reply.model == model
        assert model not in [m.id for m in client(again, OTHER).models.list()]


def test_every_openai_field_is_honoured_or_refused_by_name(live: LiveServer, data: Path) -> None:
    """OpenAI's fine_tuning.jobs.create and files.create fields: what this server does not do
    (DPO, reinforcement, integrations) is a 400 whose `param` names the field; `metadata` and
    `expires_after` are kept; a field OpenAI does not define is a 400 too."""
    c = client(live)
    with open(data, "rb") as f:
        training = c.files.create(file=f, purpose="fine-tune")
    base = {"model": MODEL_NAME, "training_file": training.id}
    supervised = {"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 1}}}
    refused = [
        ({"method": {"type": "dpo", "dpo": {"hyperparameters": {"beta": 0.1}}}}, "method.type"),
        ({"method": {"type": "reinforcement"}}, "method.type"),
        ({"method": {**supervised, "dpo": {}}}, "method.dpo"),
        ({"method": {"type": "supervised", "supervised": "yes"}}, "method"),
        ({"method": supervised, "hyperparameters": {"n_epochs": 2}}, "hyperparameters"),
        ({"integrations": [{"type": "wandb", "wandb": {"project": "p"}}]}, "integrations"),
        ({"hyperparameters": {"n_epochs": 0}}, "hyperparameters"),
        ({"hyperparameters": {"epochs": 3}}, "hyperparameters"),
        ({"seed": -1}, "seed"),
        ({"seed": True}, "seed"),
        ({"suffix": "no spaces"}, "suffix"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"metadata": {"k": 1}}, "metadata"),
        ({"validation_file": "file-unknown"}, "validation_file"),
        ({"training_file": "file-unknown"}, "training_file"),
        ({"model": "gpt-4o-mini"}, "model"),
    ]
    for extra, param in refused:
        with pytest.raises(openai.BadRequestError) as caught:
            c.fine_tuning.jobs.create(**{**base, **extra})
        assert caught.value.body["param"] == param, (extra, caught.value.body)
    with pytest.raises(openai.BadRequestError) as caught:
        c.fine_tuning.jobs.create(**base, method={"type": "dpo"})
    assert "'dpo' is not supported" in caught.value.body["message"]
    with pytest.raises(openai.BadRequestError) as caught:  # nothing a job is given is ignored
        c.fine_tuning.jobs.create(**base, extra_body={"not_an_openai_field": 1})
    assert caught.value.body["param"] == "not_an_openai_field"
    with open(data, "rb") as f, pytest.raises(openai.BadRequestError) as caught:
        c.files.create(file=f, purpose="fine-tune", extra_body={"not_a_form_field": "1"})
    assert caught.value.body["param"] == "not_a_form_field"
    job = c.fine_tuning.jobs.create(
        **base, method=supervised, integrations=[], metadata={"team": "docs"}, seed=3
    )
    assert job.metadata == {"team": "docs"} and job.seed == 3 and job.method.type == "supervised"
    assert c.fine_tuning.jobs.cancel(job.id).status == "cancelled"
    # files.create: expires_after kept as expires_at, and honoured
    with open(data, "rb") as f:
        expiring = c.files.create(
            file=f, purpose="fine-tune", expires_after={"anchor": "created_at", "seconds": 3600}
        )
    assert expiring.expires_at == expiring.created_at + 3600
    for bad, param in (
        ({"anchor": "created_at", "seconds": 60}, "expires_after[seconds]"),
        ({"anchor": "last_active_at", "seconds": 3600}, "expires_after[anchor]"),
    ):
        with pytest.raises(openai.BadRequestError) as caught, open(data, "rb") as f:
            c.files.create(file=f, purpose="fine-tune", expires_after=bad)  # type: ignore[arg-type]
        assert caught.value.body["param"] == param, caught.value.body
    live.app.state.fine_tuning.files.records[expiring.id]["expires_at"] = int(time.time()) - 1
    assert expiring.id not in [f.id for f in c.files.list()]
    with pytest.raises(openai.NotFoundError):
        c.files.retrieve(expiring.id)


def test_off_without_the_flag(server: LiveServer) -> None:
    c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="test-key-123", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        c.files.list()
    with pytest.raises(openai.NotFoundError):
        c.fine_tuning.jobs.list()


def test_the_training_process_runs_niced_with_bounded_threads(tmp_path: Path) -> None:
    import os
    import sys

    from gptserve.server.fine_tuning.runner import LOG_FILE, NICE, TrainingProcess

    script = "import os; print(os.nice(0), os.environ['OMP_NUM_THREADS'])"
    process = TrainingProcess([sys.executable, "-c", script], tmp_path, threads=1)
    assert process.proc.wait(30) == 0
    assert (tmp_path / LOG_FILE).read_text().split() == [str(os.nice(0) + NICE), "1"]


def test_hyperparameters_auto_and_bounds() -> None:
    from gptserve.server.errors import APIError
    from gptserve.server.fine_tuning import recipe

    asked = recipe.requested_hyperparameters({})
    assert asked == dict.fromkeys(recipe.BOUNDS, "auto")
    method = {"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 5}}}
    assert recipe.requested_hyperparameters({"method": method})["n_epochs"] == 5
    hyper = recipe.resolve(asked, examples=30)
    assert hyper == {"n_epochs": 3, "batch_size": 4, "learning_rate_multiplier": 1.0}
    assert recipe.total_steps(hyper, 30, None) == (24, 8)  # ceil(30 / 4) = 8 an epoch
    assert recipe.total_steps(hyper, 30, 5) == (5, 8)
    for bad in ({"n_epochs": 0}, {"batch_size": 1.5}, {"learning_rate_multiplier": "x"},
                {"epochs": 3}):  # fmt: skip
        with pytest.raises(APIError):
            recipe.requested_hyperparameters({"hyperparameters": bad})
