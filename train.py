#!/usr/bin/env python
"""Train a GPT on UTF-8 text; the output directory is directly servable (`python -m server --model DIR`).

    python train.py --data shakespeare.txt --out runs/shakespeare --max-steps 2000
    python train.py --out runs/shakespeare --resume            # continue a killed run
    torchrun --nproc_per_node 2 train.py --data ... --out ...  # DistributedDataParallel

Writes into DIR: config.json + model.safetensors (last), best/ (lowest validation loss),
train_state.pt (everything --resume needs, full fp32 weights included), metrics.jsonl, loss.png
and cache/ (the tokenized data). See docs/TRAINING.md.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

import kernels
from model import (
    GPT,
    CheckpointError,
    ConfigError,
    ModelConfig,
    get_tokenizer,
    load_checkpoint,
    save_checkpoint,
)
from model.checkpoint import atomic_write
from model.cpu_memory import retain_freed_memory

STATE_FILE = "train_state.pt"
METRICS_FILE = "metrics.jsonl"
BEST_DIR = "best"
MAX_BAD_STEPS = 5  # consecutive non-finite losses before training stops
ARCH_KEYS = ("n_layer", "n_head", "n_embd", "block_size", "pos_encoding", "activation",
             "norm_position")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

DEFAULTS: dict[str, Any] = {
    "data": None, "out": None, "cache_dir": None, "max_steps": 5000, "device": "auto",
    "dtype": "auto", "compile": False, "n_layer": 6, "n_head": 6, "n_embd": 384,
    "block_size": 256, "dropout": 0.0, "pos_encoding": "learned", "activation": "gelu",
    "norm_position": "pre", "batch_size": 8, "grad_accum": 1, "lr": 6e-4, "min_lr": None,
    "warmup_steps": 100, "weight_decay": 0.1, "beta1": 0.9, "beta2": 0.95, "grad_clip": 1.0,
    "eval_interval": 250, "eval_iters": 20, "log_interval": 10, "sample_tokens": 48,
    "seed": 1337, "val_fraction": 0.1, "init_from": None, "resume": False,
    "save_dtype": "float32", "threads": None,
}


class TrainError(Exception):
    """A problem the user can fix; printed as one `error: ...` line, exit code 2."""

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line instead of usage + message
        raise TrainError(f"{message} (see --help)")


# ----------------------------------------------------------------------------- arguments

def build_parser() -> argparse.ArgumentParser:
    # Every default is SUPPRESS so that we can tell which flags were given: with --resume the
    # flags not given come from the saved run, then from DEFAULTS.
    p = _Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                argument_default=argparse.SUPPRESS)
    a = p.add_argument
    a("--data", help="UTF-8 text file or folder of .txt files")
    a("--out", help="output directory (checkpoints, metrics)")
    a("--cache-dir", help="where tokenized data is cached (default: OUT/cache)")
    a("--max-steps", type=int, help="total optimizer steps (default 5000)")
    a("--device", choices=["auto", "cpu", "cuda"])
    a("--dtype", choices=["auto", *DTYPES], help="autocast dtype (auto: bf16 on CUDA, fp32 on CPU)")
    a("--compile", action="store_true", help="torch.compile the training step")
    g = p.add_argument_group("model")
    for name in ("--n-layer", "--n-head", "--n-embd", "--block-size"):
        g.add_argument(name, type=int)
    g.add_argument("--dropout", type=float)
    g.add_argument("--pos-encoding", choices=["learned", "sinusoidal"])
    g.add_argument("--activation", choices=["gelu", "relu"])
    g.add_argument("--norm-position", choices=["pre", "post"])
    g.add_argument("--init-from", help="start from a checkpoint dir (ours or Hugging Face GPT-2)")
    o = p.add_argument_group("optimization")
    for name in ("--batch-size", "--grad-accum", "--warmup-steps"):
        o.add_argument(name, type=int)
    for name in ("--lr", "--min-lr", "--weight-decay", "--beta1", "--beta2", "--grad-clip"):
        o.add_argument(name, type=float)
    o.add_argument("--seed", type=int)
    o.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    e = p.add_argument_group("evaluation and output")
    for name in ("--eval-interval", "--eval-iters", "--log-interval", "--sample-tokens"):
        e.add_argument(name, type=int)
    e.add_argument("--val-fraction", type=float, help="tail of the data held out (default 0.1)")
    e.add_argument("--save-dtype", choices=list(DTYPES), help="dtype of the served weights")
    e.add_argument("--resume", action="store_true", help="continue the run in --out")
    return p


def resolve_args(argv: list[str] | None) -> argparse.Namespace:
    """Parse argv; fill flags not given from the resumed run (with --resume) and DEFAULTS."""
    given = vars(build_parser().parse_args(argv))
    if not given.get("out"):
        raise TrainError("--out DIR is required")
    settings = dict(DEFAULTS)
    if given.get("resume"):
        saved = read_train_state(Path(given["out"]))["args"]
        for key in ARCH_KEYS:
            if key in given and given[key] != saved[key]:
                raise TrainError(
                    f"--out {given['out']} holds a model with {key}={saved[key]}; --resume cannot "
                    f"change it to {given[key]}"
                )
        settings.update({k: v for k, v in saved.items() if k in DEFAULTS})
        settings["init_from"] = None  # the weights come from the training state
    elif given.get("init_from"):
        clash = [k for k in ARCH_KEYS if k in given]
        if clash:
            raise TrainError(f"--init-from takes the architecture from the checkpoint; drop "
                             f"--{clash[0].replace('_', '-')}")
    settings.update(given)
    settings["resume"] = bool(given.get("resume"))
    args = argparse.Namespace(**settings)
    if args.min_lr is None:
        args.min_lr = args.lr / 10
    check_args(args)
    return args


def check_args(a: argparse.Namespace) -> None:
    if not a.data:
        raise TrainError("--data PATH is required")
    for key in ("max_steps", "batch_size", "grad_accum", "eval_interval", "eval_iters",
                "log_interval", "n_layer", "n_head", "n_embd", "block_size"):
        if getattr(a, key) <= 0:
            raise TrainError(f"--{key.replace('_', '-')} must be positive, got {getattr(a, key)}")
    if not a.lr > 0:
        raise TrainError(f"--lr must be positive, got {a.lr}")
    for key in ("warmup_steps", "sample_tokens", "weight_decay", "grad_clip", "min_lr"):
        if getattr(a, key) < 0:
            raise TrainError(f"--{key.replace('_', '-')} must be >= 0, got {getattr(a, key)}")
    if not 0.0 <= a.val_fraction < 1.0:
        raise TrainError(f"--val-fraction must be in [0, 1), got {a.val_fraction}")
    if a.threads is not None and a.threads <= 0:
        raise TrainError(f"--threads must be positive, got {a.threads}")
    if not a.init_from:
        try:
            model_config(a)
        except ConfigError as exc:
            raise TrainError(str(exc)) from None


def model_config(a: argparse.Namespace, vocab_size: int = 50257) -> ModelConfig:
    return ModelConfig(
        vocab_size=vocab_size, block_size=a.block_size, n_layer=a.n_layer, n_head=a.n_head,
        n_embd=a.n_embd, dropout=a.dropout, pos_encoding=a.pos_encoding,
        activation=a.activation, norm_position=a.norm_position,
    )


def arch(config: ModelConfig) -> dict[str, Any]:
    """The fields that make two configs the same model (dropout is a training choice)."""
    return {k: v for k, v in asdict(config).items() if k != "dropout"}


# ----------------------------------------------------------------------------- data

def find_text_files(path: Path) -> list[Path]:
    if not path.exists():
        raise TrainError(f"data path {path} does not exist")
    files = sorted(p for p in path.rglob("*.txt") if p.is_file()) if path.is_dir() else [path]
    if not files:
        raise TrainError(f"data folder {path} has no .txt files")
    if all(f.stat().st_size == 0 for f in files):
        raise TrainError(f"data path {path} is empty")
    return files


def tokenize_cached(files: list[Path], cache_dir: Path, tokenizer: str = "gpt2",
                    progress: bool = True) -> Path:
    """Encode files once into a uint16 token file (documents separated by <|endoftext|>).

    The file name carries a hash of the tokenizer name and each file's path, size and mtime,
    so an unchanged dataset is never encoded twice.
    """
    h = hashlib.sha256(tokenizer.encode())
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    target = cache_dir / f"tokens-{tokenizer}-{h.hexdigest()[:16]}.bin"
    if target.is_file():
        return target
    tok = get_tokenizer(tokenizer)
    if tok.vocab_size > 2**16:
        raise TrainError(f"tokenizer {tokenizer} has {tok.vocab_size} tokens; uint16 holds 65536")
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    total = sum(f.stat().st_size for f in files)
    try:
        with open(tmp, "wb") as out, tqdm(total=total, unit="B", unit_scale=True,
                                           desc="tokenizing", disable=not progress) as bar:
            for i, f in enumerate(files):
                if i > 0:
                    out.write(np.array([tok.eot_token], dtype=np.uint16).tobytes())
                for texts in _text_chunks(f):
                    ids = tok.encode_batch(texts)  # tiktoken encodes a batch on several threads
                    out.write(np.concatenate([np.asarray(x, dtype=np.uint16) for x in ids])
                              .tobytes())
                    bar.update(sum(len(t.encode("utf-8")) for t in texts))
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def _text_chunks(path: Path, piece_chars: int = 1 << 16, batch: int = 16):
    """Yield lists of ~64k-character pieces cut at line ends (BPE never merges across them)."""
    texts: list[str] = []
    piece: list[str] = []
    size = 0
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                piece.append(line)
                size += len(line)
                if size >= piece_chars:
                    texts.append("".join(piece))
                    piece, size = [], 0
                    if len(texts) == batch:
                        yield texts
                        texts = []
    except UnicodeDecodeError as exc:
        raise TrainError(f"data file {path} is not UTF-8 text ({exc.reason} at byte "
                         f"{exc.start})") from None
    if piece:
        texts.append("".join(piece))
    if texts:
        yield texts


def split_tokens(tokens: np.ndarray, block_size: int, val_fraction: float
                 ) -> tuple[np.ndarray, np.ndarray | None]:
    """The last val_fraction of the tokens is the validation split; both must hold a block + 1."""
    n = len(tokens)
    n_val = int(n * val_fraction)
    train, val = tokens[: n - n_val], (tokens[n - n_val:] if val_fraction > 0 else None)
    if len(train) < block_size + 1 or (val is not None and len(val) < block_size + 1):
        need = math.ceil((block_size + 1) / min(1 - val_fraction, val_fraction or 1.0))
        raise TrainError(
            f"data has {n} tokens, too few for --block-size {block_size} with --val-fraction "
            f"{val_fraction} (need at least {need}); use more data or a smaller --block-size"
        )
    return train, val


class BatchSampler:
    """Random (B, T) windows from a token array, from its own seeded RNG (restorable)."""

    def __init__(self, tokens: np.ndarray, block_size: int, batch_size: int,
                 seed: list[int]) -> None:
        self.tokens = tokens
        self.block_size = block_size
        self.batch_size = batch_size
        self.rng = np.random.default_rng(seed)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        T = self.block_size
        starts = self.rng.integers(0, len(self.tokens) - T, size=self.batch_size)
        window = np.stack([self.tokens[s: s + T + 1] for s in starts]).astype(np.int64)
        window = torch.from_numpy(window)  # (B, T + 1)
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()

    def state_dict(self) -> dict[str, Any]:
        return self.rng.bit_generator.state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rng.bit_generator.state = state


# ----------------------------------------------------------------------------- training step

class LossModule(nn.Module):
    """forward(x, y) -> loss, so that DDP and torch.compile see the whole training forward."""

    def __init__(self, model: GPT) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.model.loss(x, y)


def make_optimizer(model: nn.Module, a: argparse.Namespace, device_type: str
                   ) -> torch.optim.AdamW:
    """AdamW; weight decay only on matrices (>= 2-D), fused kernels where available."""
    params = [p for p in model.parameters() if p.requires_grad]  # tied weights appear once
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": a.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=a.lr, betas=(a.beta1, a.beta2), eps=1e-8, fused=True)


def lr_at(step: int, a: argparse.Namespace) -> float:
    """Linear warmup over warmup_steps, then cosine decay to min_lr at max_steps."""
    if step < a.warmup_steps:
        return a.lr * (step + 1) / a.warmup_steps
    if step >= a.max_steps:
        return a.min_lr
    ratio = (step - a.warmup_steps) / max(1, a.max_steps - a.warmup_steps)
    return a.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (a.lr - a.min_lr)


def train_step(module: nn.Module, optimizer: torch.optim.Optimizer,
               batches: list[tuple[torch.Tensor, torch.Tensor]], grad_clip: float,
               autocast: contextlib.AbstractContextManager | None = None,
               scaler: torch.amp.GradScaler | None = None) -> tuple[float, float, bool]:
    """One optimizer update over micro-batches (gradient accumulation).

    Under DDP gradients are all-reduced on the last micro-batch only, and the returned loss is
    the mean over ranks. A step whose loss or gradient norm is not finite changes no weight.
    Returns (loss, grad_norm, applied).
    """
    ddp = isinstance(module, DDP)
    optimizer.zero_grad(set_to_none=True)
    total = torch.zeros((), device=batches[0][0].device)
    for i, (x, y) in enumerate(batches):
        sync = module.no_sync() if ddp and i < len(batches) - 1 else contextlib.nullcontext()
        with sync:
            with autocast or contextlib.nullcontext():
                loss = module(x, y) / len(batches)
            (scaler.scale(loss) if scaler is not None else loss).backward()
        total += loss.detach().float()
    if ddp:
        dist.all_reduce(total)
        total /= dist.get_world_size()
    if scaler is not None:
        scaler.unscale_(optimizer)
    norm = float(torch.nn.utils.clip_grad_norm_(module.parameters(),
                                                grad_clip if grad_clip > 0 else math.inf))
    loss_value = total.item()
    # With a GradScaler, inf gradients are its business (it skips and lowers the scale).
    applied = math.isfinite(loss_value) and (scaler is not None or math.isfinite(norm))
    if applied:
        if scaler is not None:
            scaler.step(optimizer)
        else:
            optimizer.step()
    if scaler is not None:
        scaler.update()
    return loss_value, norm, applied


@torch.no_grad()
def evaluate(model: GPT, sampler: BatchSampler, iters: int, device: torch.device,
             autocast: contextlib.AbstractContextManager) -> float:
    """Mean loss over `iters` batches (the sampler is fresh each time: same batches every eval)."""
    model.eval()
    losses = torch.zeros(iters)
    for i in range(iters):
        x, y = sampler.next()
        with autocast:
            losses[i] = model.loss(x.to(device), y.to(device)).float().cpu()
    model.train()
    value = losses.mean()
    if dist.is_initialized():
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return float(value)


@torch.no_grad()
def sample_text(model: GPT, n_tokens: int, device: torch.device, seed: int) -> str:
    """A short top-k sample from <|endoftext|>, from a private generator (no global RNG use)."""
    tok = get_tokenizer(model.config.tokenizer)
    gen = torch.Generator(device=device).manual_seed(seed)
    idx = torch.tensor([[tok.eot_token]], device=device)
    model.eval()
    for _ in range(n_tokens):
        logits = model(idx[:, -model.config.block_size:])[:, -1, :].float() / 0.8  # (1, V)
        top, where = torch.topk(logits, 40)
        choice = torch.multinomial(torch.softmax(top, dim=-1), 1, generator=gen)
        idx = torch.cat([idx, where.gather(-1, choice)], dim=1)
    model.train()
    return tok.decode(idx[0, 1:].tolist())


# ----------------------------------------------------------------------------- state on disk

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


# ----------------------------------------------------------------------------- metrics

def append_metrics(path: Path, row: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def trim_metrics(path: Path, last_step: int) -> None:
    """Drop lines logged after the checkpoint we resume from (a killed run may have gone on)."""
    if not path.is_file():
        return
    rows = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= last_step:
                rows.append(line)
        except (json.JSONDecodeError, KeyError, TypeError):
            continue  # a line cut short by the kill
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(r + "\n" for r in rows))
    os.replace(tmp, path)


def plot_losses(metrics: Path, target: Path) -> None:
    """DIR/loss.png from metrics.jsonl; silently nothing when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in rows], [r["train_loss"] for r in rows], label="train")
    val = [r for r in rows if "val_loss" in r]
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="val")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    ax.grid(alpha=0.3)
    tmp = target.with_name(f".{target.name}.tmp")
    fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)
    os.replace(tmp, target)


# ----------------------------------------------------------------------------- setup

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
        info = Dist(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                    int(os.environ.get("LOCAL_RANK", 0)))
    if use_cuda:
        torch.cuda.set_device(info.local_rank)
        device = torch.device("cuda", info.local_rank)
    else:
        device = torch.device("cpu")
    if info.world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo")
    return device, info


def autocast_for(a: argparse.Namespace, device: torch.device
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
        print(f"note: {out} holds a run; starting over (use --resume to continue it)",
              file=sys.stderr)


def prepare_data(a: argparse.Namespace, info: Dist, out: Path) -> np.ndarray:
    """Tokenize on rank 0 (others wait), then memory-map the token file on every rank."""
    files = find_text_files(Path(a.data))
    cache = Path(a.cache_dir) if a.cache_dir else out / "cache"
    result: list[Any] = [None]
    if info.master:
        try:
            result = [str(tokenize_cached(files, cache))]
        except TrainError as exc:
            result = [exc]
    if dist.is_initialized():
        dist.broadcast_object_list(result, src=0)
    if isinstance(result[0], Exception):
        raise TrainError(str(result[0]))
    return np.memmap(result[0], dtype=np.uint16, mode="r")


# ----------------------------------------------------------------------------- main loop

def train(a: argparse.Namespace) -> None:
    if a.threads:
        torch.set_num_threads(a.threads)
    device, info = setup_device(a)
    if device.type == "cpu":
        retain_freed_memory()  # the logits alone are ~400 MB a step: reuse, don't page-fault
    out = Path(a.out)
    state = read_train_state(out) if a.resume else None
    vocab_size = get_tokenizer("gpt2").vocab_size
    if not a.init_from:
        check_out_dir(out, model_config(a, vocab_size), a)  # before the slow parts
    tokens = prepare_data(a, info, out)
    model = build_model(a, vocab_size, state)
    train_tokens, val_tokens = split_tokens(tokens, model.config.block_size, a.val_fraction)
    if device.type == "cuda" and kernels.get_backend() == "auto":
        import importlib.util

        if importlib.util.find_spec("kernels.flash") is None:  # Triton kernels not there yet
            kernels.set_backend("torch")
    model.to(device)
    autocast, scaler = autocast_for(a, device)
    optimizer = make_optimizer(model, a, device.type)
    sampler = BatchSampler(train_tokens, model.config.block_size, a.batch_size, [a.seed, info.rank])
    torch.manual_seed(a.seed + info.rank)  # dropout masks differ across ranks
    step, best_val = 0, math.inf
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        if scaler is not None and state.get("scaler"):
            scaler.load_state_dict(state["scaler"])
        step, best_val = state["step"], state["best_val"]
        ranks = state["ranks"]
        if len(ranks) == info.world:
            sampler.load_state_dict(ranks[info.rank]["sampler"])
            set_rng_state(ranks[info.rank]["rng"])
        else:  # another world size: fresh per-rank streams, derived from the step
            sampler = BatchSampler(train_tokens, model.config.block_size, a.batch_size,
                                   [a.seed, info.rank, step])
            torch.manual_seed(a.seed + info.rank + step)
    metrics = out / METRICS_FILE
    if info.master:
        out.mkdir(parents=True, exist_ok=True)
        if state is not None:
            trim_metrics(metrics, step)
        else:
            metrics.unlink(missing_ok=True)

    train_module: nn.Module = LossModule(model)
    if a.compile:
        train_module.compile()
    if info.world > 1:
        train_module = DDP(train_module, device_ids=[device.index] if device.type == "cuda"
                           else None)
    tokens_per_step = a.batch_size * a.grad_accum * model.config.block_size * info.world
    if info.master:
        print(f"model: {model.num_params() / 1e6:.2f}M parameters, {model.config.n_layer} layers, "
              f"{model.config.n_head} heads, width {model.config.n_embd}, block "
              f"{model.config.block_size}; data: {len(train_tokens):,} train / "
              f"{0 if val_tokens is None else len(val_tokens):,} val tokens; {tokens_per_step:,} "
              f"tokens/step on {info.world} x {device.type}", flush=True)
    if step >= a.max_steps:
        if info.master:
            print(f"already at step {step} >= --max-steps {a.max_steps}; nothing to do")
        return

    def checkpoint(val_loss: float | None) -> None:
        nonlocal best_val
        improved = val_loss is not None and val_loss < best_val
        if improved:
            best_val = val_loss
        rank_states = gather_rank_states(sampler)
        if not info.master:
            return
        save_served(model, out, DTYPES[a.save_dtype])
        if improved:
            save_served(model, out / BEST_DIR, DTYPES[a.save_dtype])
        atomic_torch_save({
            "version": 1, "step": step, "best_val": best_val, "args": vars(a),
            "config": model.config.to_dict(),
            "model": {k: v.detach().cpu() for k, v in model.state_dict().items()},
            "optimizer": optimizer.state_dict(),
            "scaler": scaler.state_dict() if scaler is not None else None,
            "ranks": rank_states,
        }, out / STATE_FILE)

    bar = tqdm(total=a.max_steps, initial=step, unit="step", disable=not info.master,
               dynamic_ncols=True)
    bad_steps = 0
    while step < a.max_steps:
        t0 = time.perf_counter()
        lr = lr_at(step, a)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batches = [tuple(t.to(device, non_blocking=True) for t in sampler.next())
                   for _ in range(a.grad_accum)]
        loss, norm, applied = train_step(train_module, optimizer, batches, a.grad_clip,
                                         autocast, scaler)
        step += 1
        bad_steps = 0 if applied else bad_steps + 1
        if bad_steps >= MAX_BAD_STEPS:
            raise TrainError(
                f"loss or gradient not finite for {bad_steps} consecutive steps (last at step "
                f"{step}); weights were not updated by them; the last checkpoint is intact; "
                f"try a lower --lr or --dtype float32", exit_code=1)
        if not applied:
            bar.write(f"step {step}: non-finite loss/gradient ({loss}, {norm}); step skipped")
        elapsed = time.perf_counter() - t0
        tok_s = tokens_per_step / max(elapsed, 1e-9)
        bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tok_s:,.0f}", refresh=False)
        bar.update(1)
        row: dict[str, Any] = {"step": step, "train_loss": loss, "lr": lr,
                               "tokens_per_s": round(tok_s, 1)}
        if not applied:
            row["skipped"] = True
        is_eval = step % a.eval_interval == 0 or step == a.max_steps
        val_loss = None
        if is_eval and val_tokens is not None:
            val_sampler = BatchSampler(val_tokens, model.config.block_size, a.batch_size,
                                       [a.seed, info.rank, 1])
            val_loss = evaluate(model, val_sampler, a.eval_iters, device, autocast)
            row["val_loss"] = val_loss
        # The row goes to disk before the checkpoint: a kill in between resumes from the
        # previous checkpoint and drops the row, never losing one that the checkpoint covers.
        if info.master and (is_eval or step % a.log_interval == 0):
            append_metrics(metrics, row)
        if is_eval:
            checkpoint(val_loss)
            if info.master:
                plot_losses(metrics, out / "loss.png")
                text = sample_text(model, a.sample_tokens, device, a.seed) if a.sample_tokens \
                    else ""
                msg = f"step {step}: train {loss:.4f}"
                msg += f", val {val_loss:.4f}" if val_loss is not None else ""
                bar.write(msg + (f" | sample: {text!r}" if text else ""))
    bar.close()
    if info.master:
        print(f"done: {step} steps; checkpoint in {out}"
              + (f", best val loss {best_val:.4f} in {out / BEST_DIR}" if best_val < math.inf
                 else ""))


def main(argv: list[str] | None = None) -> int:
    try:
        args = resolve_args(argv)
        train(args)
    except TrainError as exc:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted; continue with --resume", file=sys.stderr)
        return 130
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
