"""What a run keeps on disk for --resume: train_state.pt (weights, optimizer, the run's flags, the
RNG and sampler states of every rank) and the served checkpoints, each written atomically."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gptserve.model import GPT, save_checkpoint
from gptserve.model.checkpoint import atomic_write
from gptserve.model.lora.adapter import LoraPiece
from gptserve.model.lora.peft_format import write_peft
from gptserve.training.config import TrainConfig
from gptserve.training.errors import TrainError
from gptserve.training.lora import adapter_of, lora_state, merge_lora

STATE_FILE = "train_state.pt"
BEST_DIR = "best"
MERGED_DIR = "merged"  # a LoRA run's --merge: the base with the adapter added in
# What a checkpoint with its own tokenizer ("hf") needs beside its weights to be served: the
# files model/tokenizers/hf.py and server/chat/templates.py read, those that exist.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "chat_template.jinja",
)


def atomic_torch_save(obj: Any, target: Path) -> None:
    """torch.save through a temp file in the same directory, fsync, rename."""
    atomic_write(target, lambda tmp: torch.save(obj, tmp))


def read_train_state(out: Path, mmap: bool = False) -> dict[str, Any]:
    """train_state.pt of the run in `out`; with mmap, tensors are read only when touched."""
    path = out / STATE_FILE
    if not path.is_file():
        raise TrainError(f"nothing to resume: {path} does not exist (drop --resume to start)")
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as exc:  # torch raises many types for corrupt files
        raise TrainError(f"cannot read {path}: {exc}".splitlines()[0]) from None


def read_saved_flags(out: Path) -> dict[str, Any]:
    """The flags the run in `out` was started with (its weights stay on disk)."""
    return read_train_state(out, mmap=True)["args"]


def read_tokenizer_files(directory: Path | None) -> dict[str, bytes]:
    """The TOKENIZER_FILES in `directory` by name (none for None), to write beside each served
    checkpoint; read once at the start, so a source that changes later does not matter."""
    if directory is None:
        return {}
    found = [name for name in TOKENIZER_FILES if (directory / name).is_file()]
    try:
        return {name: (directory / name).read_bytes() for name in found}
    except OSError as exc:
        raise TrainError(f"cannot read the tokenizer files in {directory}: {exc}") from None


def save_served(
    model: GPT, path: Path, dtype: torch.dtype, extra_files: dict[str, bytes] | None = None
) -> None:
    """The server's checkpoint (config.json + model.safetensors) in `dtype`, and `extra_files`
    (the tokenizer's) beside it, each file atomically."""
    if dtype == torch.float32:
        save_checkpoint(model, path)
    else:
        with torch.random.fork_rng(devices=[]):  # building a copy must not move the training RNG
            copy = GPT(model.config)
        copy.load_state_dict(model.state_dict())
        save_checkpoint(copy.to(dtype), path)
    for name, data in (extra_files or {}).items():
        atomic_write(path / name, lambda tmp, d=data: Path(tmp).write_bytes(d))


def save_outputs(
    model: GPT,
    cfg: TrainConfig,
    path: Path,
    dtype: torch.dtype,
    extra_files: dict[str, bytes] | None = None,
) -> None:
    """A checkpoint of the run into `path`: the served model (`save_served`), or for a LoRA run
    its PEFT adapter, whose base_model_name_or_path is the --init-from base."""
    if cfg.lora_rank is None:
        save_served(model, path, dtype, extra_files)
        return
    adapter = adapter_of(model, cfg.out.name, cfg.lora_rank, cfg.alpha, str(cfg.init_from))
    for layer, pieces in adapter.pieces.items():
        adapter.pieces[layer] = [
            LoraPiece(a=p.a.to(dtype), b=p.b.to(dtype), offset=p.offset) for p in pieces
        ]
    write_peft(adapter, path, model.config, adapter.base, dropout=cfg.lora_dropout)


def model_state(model: GPT, cfg: TrainConfig) -> dict[str, torch.Tensor]:
    """What train_state.pt keeps of the model: its weights, or a LoRA run's pairs only."""
    if cfg.lora_rank is not None:
        return lora_state(model)
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def save_merged(
    model: GPT, cfg: TrainConfig, dtype: torch.dtype, extra_files: dict[str, bytes]
) -> Path:
    """--merge: the adapter added into the base's weights, saved in OUT/merged as a servable
    checkpoint (with the tokenizer files). The model's LoRA layers are unwrapped for good."""
    assert cfg.lora_rank is not None
    adapter = adapter_of(model, cfg.out.name, cfg.lora_rank, cfg.alpha, str(cfg.init_from))
    merge_lora(model, adapter)
    save_served(model, cfg.out / MERGED_DIR, dtype, extra_files)
    return cfg.out / MERGED_DIR


def rng_state() -> dict[str, Any]:
    """The global RNGs of this process, as plain tensors and lists."""
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
