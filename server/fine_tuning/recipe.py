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


def requested_hyperparameters(body: dict[str, Any]) -> dict[str, Any]:
    """`hyperparameters`, or `method.supervised.hyperparameters`, checked: each "auto" (the
    default) or a number in its bounds; a 400 otherwise."""
    given = body.get("hyperparameters")
    method = body.get("method")
    if method is not None:
        if not isinstance(method, dict) or method.get("type", "supervised") != "supervised":
            raise APIError(400, "method: only 'supervised' fine-tuning is supported", "method")
        supervised = method.get("supervised") or {}
        given = supervised.get("hyperparameters") or given
    given = given or {}
    if not isinstance(given, dict):
        raise APIError(400, "hyperparameters must be an object", "hyperparameters")
    unknown = sorted(set(given) - set(BOUNDS))
    if unknown:
        raise APIError(400, f"unknown hyperparameter {unknown[0]!r}", "hyperparameters")
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
                400, f"hyperparameters.{name} must be 'auto' or {kind} in [{low:g}, {high:g}]",
                f"hyperparameters.{name}",
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
    per_epoch: int, seed: int, threads: int,
) -> list[str]:  # fmt: skip
    """The subprocess's command line: `python -m gptserve.training ...` (gptserve train)."""
    argv = [
        sys.executable, "-m", "gptserve.training", "--init-from", str(base), "--chat-data",
        "--data", str(data), "--out", str(out), "--lora-rank", str(LORA_RANK),
        "--lora-targets", "all", "--max-steps", str(steps),
        "--batch-size", str(hyper["batch_size"]),
        "--lr", repr(BASE_LR * hyper["learning_rate_multiplier"]),
        "--warmup-steps", str(steps // 10), "--eval-interval", str(min(per_epoch, steps)),
        "--log-interval", str(max(1, steps // 50)), "--sample-tokens", "0",
        "--seed", str(seed), "--threads", str(threads), "--overwrite",
    ]  # fmt: skip
    argv += ["--val-data", str(val)] if val is not None else ["--val-fraction", "0"]
    return argv
