"""A fine-tuning job's hyperparameters and the `gptserve train` command line that runs it.

OpenAI's three hyperparameters, each a number or "auto":

- `n_epochs` (auto: 3): passes over the training file; the run's --max-steps is
  ceil(examples x epochs / batch_size), at most --fine-tune-max-steps when the server sets it;
- `batch_size` (auto: min(4, examples)): examples a step;
- `learning_rate_multiplier` (auto: 1): times BASE_LR, 2e-3 (LoRA's updates start at zero and
  want a higher rate than full training's).

The job trains a LoRA adapter of rank 16 (alpha 32) on every projection of the served base
(`--init-from` the checkpoint directory or GGUF file the server loaded), with the training
file as chat data (training.chat_data: the served model's own chat template), the validation
file as --val-data (else none held out), warmup over the first tenth of the steps, and the
validation loss (if any) once an epoch. With them 30 copies of one planted fact were learned
by SmolLM2-135M (24 steps, 63 s to 2 min on one thread of a 2-core CPU;
bench/fine_tune_serving.py, docs/BENCHMARKS.md).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

from gptserve.server.errors import APIError

DEFAULT_EPOCHS = 3
DEFAULT_BATCH = 4
BASE_LR = 2e-3
LORA_RANK = 16
BOUNDS = {"n_epochs": (1, 50), "batch_size": (1, 256), "learning_rate_multiplier": (1e-6, 100.0)}


def _method_hyperparameters(method: Any) -> Any:
    """`method.supervised.hyperparameters` (None if not given); a 400 naming the field for a
    method this server does not train (DPO, reinforcement) or a malformed one."""
    if not isinstance(method, dict):
        raise APIError(400, "method must be an object", "method")
    kind = method.get("type", "supervised")
    if kind != "supervised":
        raise APIError(
            400, f"method.type {kind!r} is not supported: this server trains 'supervised' only "
            "(no DPO or reinforcement fine-tuning)", "method.type",
        )  # fmt: skip
    for other in ("dpo", "reinforcement"):
        if method.get(other) is not None:
            raise APIError(
                400, f"method.{other} is not supported with method.type 'supervised'",
                f"method.{other}",
            )  # fmt: skip
    supervised = method.get("supervised")
    if supervised is None:
        return None
    if not isinstance(supervised, dict):
        raise APIError(400, "method.supervised must be an object", "method.supervised")
    return supervised.get("hyperparameters")


def requested_hyperparameters(body: dict[str, Any]) -> dict[str, Any]:
    """`hyperparameters`, or `method.supervised.hyperparameters` (not both), checked: each
    "auto" (the default) or a number in its bounds; a 400 naming the field otherwise."""
    given, where = body.get("hyperparameters"), "hyperparameters"
    if body.get("method") is not None:
        inner = _method_hyperparameters(body["method"])
        if inner is not None:
            if given:
                raise APIError(
                    400, "give hyperparameters or method.supervised.hyperparameters, not both",
                    "hyperparameters",
                )  # fmt: skip
            given, where = inner, "method.supervised.hyperparameters"
    given = {} if given is None else given
    if not isinstance(given, dict):
        raise APIError(400, f"{where} must be an object", where)
    unknown = sorted(set(given) - set(BOUNDS))
    if unknown:
        raise APIError(
            400, f"unknown hyperparameter {unknown[0]!r} (known: {', '.join(BOUNDS)})",
            f"{where}.{unknown[0]}",
        )  # fmt: skip
    out: dict[str, Any] = {}
    for name, (low, high) in BOUNDS.items():
        value = given.get(name, "auto")
        if value is None:
            value = "auto"
        integer = name != "learning_rate_multiplier"
        ok = value == "auto" or (
            isinstance(value, (int, float))
            and not isinstance(value, bool)
            and (not integer or float(value).is_integer())
            and low <= value <= high
        )
        if not ok:
            kind = "an integer" if integer else "a number"
            raise APIError(
                400, f"{where}.{name} must be 'auto' or {kind} in [{low:g}, {high:g}]",
                f"{where}.{name}",
            )  # fmt: skip
        out[name] = value if value == "auto" or not integer else int(value)
    return out


def resolve(hyper: dict[str, Any], examples: int) -> dict[str, Any]:
    """The "auto" values made numbers for a training file of `examples` examples."""
    return {
        "n_epochs": DEFAULT_EPOCHS if hyper["n_epochs"] == "auto" else hyper["n_epochs"],
        "batch_size": (
            max(1, min(DEFAULT_BATCH, examples))
            if hyper["batch_size"] == "auto"
            else hyper["batch_size"]
        ),  # fmt: skip
        "learning_rate_multiplier": (
            1.0
            if hyper["learning_rate_multiplier"] == "auto"
            else float(hyper["learning_rate_multiplier"])
        ),  # fmt: skip
    }


def total_steps(hyper: dict[str, Any], examples: int, max_steps: int | None) -> tuple[int, int]:
    """(the run's steps, steps an epoch) for resolved `hyper`."""
    per_epoch = max(1, math.ceil(examples / hyper["batch_size"]))
    steps = per_epoch * hyper["n_epochs"]
    return (min(steps, max_steps) if max_steps else steps), per_epoch


def train_argv(
    base: Path, data: Path, val: Path | None, out: Path, hyper: dict[str, Any], steps: int,
    per_epoch: int, seed: int, threads: int, resume: bool = False,
) -> list[str]:  # fmt: skip
    """The subprocess's command line: `python -m gptserve.training ...` (gptserve train); with
    `resume`, the run in `out` continues from its checkpoint (train_state.pt, once an epoch)."""
    argv = [
        sys.executable, "-m", "gptserve.training", "--init-from", str(base), "--chat-data",
        "--data", str(data), "--out", str(out), "--lora-rank", str(LORA_RANK),
        "--lora-targets", "all", "--max-steps", str(steps),
        "--batch-size", str(hyper["batch_size"]),
        "--lr", repr(BASE_LR * hyper["learning_rate_multiplier"]),
        "--warmup-steps", str(steps // 10), "--eval-interval", str(min(per_epoch, steps)),
        "--log-interval", str(max(1, steps // 50)), "--sample-tokens", "0",
        "--seed", str(seed), "--threads", str(threads), "--resume" if resume else "--overwrite",
    ]  # fmt: skip
    argv += ["--val-data", str(val)] if val is not None else ["--val-fraction", "0"]
    return argv
