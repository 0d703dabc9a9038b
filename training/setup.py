"""The device, the autocast precision, the model a run starts from and its tokenizer, the training
window; the --out directory check."""

from __future__ import annotations

import contextlib
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from gptserve.model import GPT, CheckpointError, ModelConfig, load_checkpoint
from gptserve.model.dtypes import DTYPES
from gptserve.model.tokenizers import Tokenizer, TokenizerError, load_tokenizer
from gptserve.training.config import TrainConfig
from gptserve.training.distributed import Dist
from gptserve.training.errors import TrainError
from gptserve.training.lora import inject_lora, resolve_targets

MAX_FINE_TUNE_WINDOW = 1024  # --init-from without --block-size: a long context's windows cap here
# "gpt2" is built in; "hf" is the tokenizer.json beside the weights, which the run copies to --out
CARRIED_TOKENIZERS = ("gpt2", "hf")


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
    """The saved model (--resume), the --init-from checkpoint, or fresh weights from cfg; for a
    LoRA run, the frozen --init-from base with new pairs (the loop puts saved ones back)."""
    if cfg.lora_rank is not None:
        model = _load_base(cfg, (*CARRIED_TOKENIZERS, "gguf"))  # a LoRA run carries none
        targets = resolve_targets(cfg.lora_targets, model.config)
        torch.manual_seed(cfg.seed)  # the same A on every rank
        inject_lora(model, targets, cfg.lora_rank, cfg.alpha, cfg.lora_dropout)
        return model
    if state is not None:  # --resume: the saved model; dropout may change
        return GPT(replace(ModelConfig.from_dict(state["config"]), dropout=cfg.dropout))
    if cfg.init_from is None:
        torch.manual_seed(cfg.seed)  # same initial weights on every rank
        return GPT(cfg.model_config(vocab_size))
    return _load_base(cfg, CARRIED_TOKENIZERS)


def _load_base(cfg: TrainConfig, tokenizers: tuple[str, ...]) -> GPT:
    """The --init-from checkpoint in float32 (a GGUF file's dequantized), with cfg's dropout."""
    assert cfg.init_from is not None
    try:
        loaded = load_checkpoint(cfg.init_from)
    except CheckpointError as exc:
        raise TrainError(f"--init-from: {exc}") from None
    if loaded.config.tokenizer not in tokenizers:
        raise TrainError(
            f"--init-from: a checkpoint with tokenizer {loaded.config.tokenizer!r} cannot be "
            f"fine-tuned (supported: {', '.join(tokenizers)}; a LoRA adapter can be trained "
            "on a GGUF file)"
        )
    model = GPT(replace(loaded.config, dropout=cfg.dropout))  # float32 weights, whatever stored
    model.load_state_dict(loaded.state_dict())
    with torch.no_grad():  # buffers the state dict leaves out (a GGUF file's rope frequencies)
        for name, buf in loaded.named_buffers():
            model.get_buffer(name).copy_(buf)
    return model


def train_window(cfg: TrainConfig, config: ModelConfig) -> int:
    """Tokens per training sequence: --block-size (a fine-tune's may be shorter than the
    checkpoint's context length), else the model's context, capped when fine-tuning."""
    if cfg.block_size is None:
        limit = MAX_FINE_TUNE_WINDOW if cfg.init_from is not None else config.block_size
        return min(config.block_size, limit)
    if cfg.block_size > config.block_size:
        raise TrainError(
            f"--block-size {cfg.block_size} exceeds the checkpoint's context length "
            f"{config.block_size}"
        )
    return cfg.block_size


def tokenizer_dir(cfg: TrainConfig, config: ModelConfig) -> Path | None:
    """Where the run's tokenizer files are: None for GPT-2's (built in); for a checkpoint's own
    ("hf"), --out on --resume (every checkpoint carries a copy), else the --init-from directory
    (always for a LoRA run, whose base stays there; for "gguf", the file)."""
    if config.tokenizer == "gpt2":
        return None
    return cfg.out if cfg.resume and cfg.lora_rank is None else cfg.init_from


def load_run_tokenizer(config: ModelConfig, directory: Path | None) -> Tokenizer:
    """The tokenizer the model was trained with, checked against its embedding."""
    try:
        tok = load_tokenizer(config.tokenizer, directory)
    except TokenizerError as exc:
        raise TrainError(f"tokenizer: {exc}") from None
    if tok.vocab_size > config.vocab_size:
        where = f"in {directory}" if directory is not None else repr(config.tokenizer)
        raise TrainError(
            f"the tokenizer {where} has {tok.vocab_size} tokens but the model embeds only "
            f"{config.vocab_size}"
        )
    return tok
