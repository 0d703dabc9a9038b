"""Device, process group, autocast and the model a run starts from; the --out directory check."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from model import GPT, CheckpointError, ConfigError, ModelConfig, load_checkpoint
from training.args import ARCH_KEYS, DTYPES, arch, model_config
from training.errors import TrainError
from training.state import STATE_FILE


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def master(self) -> bool:
        return self.rank == 0


def setup_device(a: argparse.Namespace) -> tuple[torch.device, Dist]:
    """Resolve --device and, under torchrun (RANK/WORLD_SIZE set), join the process group."""
    if a.device == "cuda" and not torch.cuda.is_available():
        raise TrainError("--device cuda: no CUDA device is available")
    use_cuda = a.device == "cuda" or (a.device == "auto" and torch.cuda.is_available())
    info = Dist()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        info = Dist(
            int(os.environ["RANK"]),
            int(os.environ["WORLD_SIZE"]),
            int(os.environ.get("LOCAL_RANK", 0)),
        )
    if use_cuda:
        torch.cuda.set_device(info.local_rank)
        device = torch.device("cuda", info.local_rank)
    else:
        device = torch.device("cpu")
    if info.world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo")
    return device, info


def autocast_for(
    a: argparse.Namespace, device: torch.device
) -> tuple[contextlib.AbstractContextManager, torch.amp.GradScaler | None]:
    name = a.dtype
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


def build_model(a: argparse.Namespace, vocab_size: int, state: dict[str, Any] | None) -> GPT:
    if state is not None and "config" in state:  # --resume: the saved model, dropout may change
        return GPT(replace(ModelConfig.from_dict(state["config"]), dropout=a.dropout))
    if not a.init_from:
        torch.manual_seed(a.seed)  # same initial weights on every rank
        return GPT(model_config(a, vocab_size))
    try:
        loaded = load_checkpoint(a.init_from)
    except CheckpointError as exc:
        raise TrainError(f"--init-from: {exc}") from None
    model = GPT(replace(loaded.config, dropout=a.dropout))
    model.load_state_dict(loaded.state_dict())
    a.block_size = model.config.block_size
    for key in ARCH_KEYS:  # saved with the run, so --resume rebuilds the same model
        setattr(a, key, getattr(model.config, key))
    return model


def check_out_dir(out: Path, config: ModelConfig, a: argparse.Namespace) -> None:
    """Refuse to overwrite a different model in --out unless it is being fine-tuned from."""
    cfg = out / "config.json"
    if a.resume or a.init_from or not cfg.is_file():
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
    if (out / STATE_FILE).is_file() and int(os.environ.get("RANK", "0")) == 0:
        print(
            f"note: {out} holds a run; starting over (use --resume to continue it)", file=sys.stderr
        )
