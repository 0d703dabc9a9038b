"""The device, the autocast precision and the model a run starts from; the --out directory check."""

from __future__ import annotations

import contextlib
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from model import GPT, CheckpointError, ConfigError, ModelConfig, load_checkpoint
from model.dtypes import DTYPES
from training.checkpointing import STATE_FILE
from training.config import TrainConfig, arch
from training.distributed import Dist
from training.errors import TrainError


def pick_device(name: str, info: Dist) -> torch.device:
    """--device: "cuda" (this rank's GPU), "cpu", or "auto" (CUDA when there is one)."""
    if name == "cuda" and not torch.cuda.is_available():
        raise TrainError("--device cuda: no CUDA device is available")
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        torch.cuda.set_device(info.local_rank)
        return torch.device("cuda", info.local_rank)
    return torch.device("cpu")


def autocast_for(
    name: str, device: torch.device
) -> tuple[contextlib.AbstractContextManager, torch.amp.GradScaler | None]:
    """--dtype as an autocast context, and the GradScaler that float16 needs."""
    if name == "auto":
        if device.type == "cuda":
            name = "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
        else:
            name = "float32"
    if name == "float16" and device.type != "cuda":
        raise TrainError("--dtype float16 needs CUDA (use bfloat16 on CPU)")
    dtype = DTYPES[name]
    ctx = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    scaler = torch.amp.GradScaler("cuda") if dtype == torch.float16 else None
    return ctx, scaler


def build_model(cfg: TrainConfig, vocab_size: int, state: dict[str, Any] | None) -> GPT:
    """The saved model (--resume), the --init-from checkpoint, or fresh weights from cfg."""
    if state is not None:  # --resume: the saved model; dropout may change
        return GPT(replace(ModelConfig.from_dict(state["config"]), dropout=cfg.dropout))
    if cfg.init_from is None:
        torch.manual_seed(cfg.seed)  # same initial weights on every rank
        return GPT(cfg.model_config(vocab_size))
    try:
        loaded = load_checkpoint(cfg.init_from)
    except CheckpointError as exc:
        raise TrainError(f"--init-from: {exc}") from None
    model = GPT(replace(loaded.config, dropout=cfg.dropout))
    model.load_state_dict(loaded.state_dict())
    return model


def check_out_dir(out: Path, config: ModelConfig) -> None:
    """Refuse to start a new run over a different model in --out."""
    cfg = out / "config.json"
    if not cfg.is_file():
        return
    try:
        existing = ModelConfig.from_json(cfg)
    except ConfigError:
        return
    diff = [k for k, v in arch(config).items() if arch(existing)[k] != v]
    if diff:
        k = diff[0]
        raise TrainError(
            f"--out {out} holds a different model ({k}={getattr(existing, k)}, this run "
            f"{getattr(config, k)}); use another --out, --resume it, or --init-from it"
        )
    if (out / STATE_FILE).is_file():
        print(
            f"note: {out} holds a run; starting over (use --resume to continue it)", file=sys.stderr
        )
