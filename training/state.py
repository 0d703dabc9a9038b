"""What a run keeps on disk: the served checkpoints and train_state.pt (weights, optimizer, RNG
and sampler states of every rank), each written atomically."""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

from model import GPT, save_checkpoint
from model.checkpoint import atomic_write
from training.errors import TrainError

if TYPE_CHECKING:
    from training.data import BatchSampler

STATE_FILE = "train_state.pt"
METRICS_FILE = "metrics.jsonl"
BEST_DIR = "best"


def atomic_torch_save(obj: Any, target: Path) -> None:
    """torch.save through a temp file in the same directory, fsync, rename."""
    atomic_write(target, lambda tmp: torch.save(obj, tmp))


def read_train_state(out: Path) -> dict[str, Any]:
    path = out / STATE_FILE
    if not path.is_file():
        raise TrainError(f"nothing to resume: {path} does not exist (drop --resume to start)")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for corrupt files
        raise TrainError(f"cannot read {path}: {exc}".splitlines()[0]) from None


def rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "python": random.getstate(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    s = state["numpy"]
    np.random.set_state((s[0], np.array(s[1], dtype=np.uint32), *s[2:]))
    random.setstate(state["python"])


def save_served(model: GPT, path: Path, dtype: torch.dtype) -> None:
    """The server's checkpoint (config.json + model.safetensors) in `dtype`."""
    if dtype == torch.float32:
        save_checkpoint(model, path)
        return
    with torch.random.fork_rng(devices=[]):  # building a copy must not move the training RNG
        copy = GPT(model.config)
    copy.load_state_dict(model.state_dict())
    save_checkpoint(copy.to(dtype), path)


def gather_rank_states(sampler: BatchSampler) -> list[dict[str, Any]]:
    """Every rank's sampler and RNG state, on every rank (rank 0 saves them)."""
    mine = {"sampler": sampler.state_dict(), "rng": rng_state()}
    if not dist.is_initialized():
        return [mine]
    states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(states, mine)
    return states
