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
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from model import ConfigError, ModelConfig
from training.errors import TrainError
from training.state import read_train_state

ARCH_KEYS = (
    "n_layer",
    "n_head",
    "n_embd",
    "block_size",
    "pos_encoding",
    "activation",
    "norm_position",
)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

DEFAULTS: dict[str, Any] = {
    "data": None,
    "out": None,
    "cache_dir": None,
    "max_steps": 5000,
    "device": "auto",
    "dtype": "auto",
    "compile": False,
    "n_layer": 6,
    "n_head": 6,
    "n_embd": 384,
    "block_size": 256,
    "dropout": 0.0,
    "pos_encoding": "learned",
    "activation": "gelu",
    "norm_position": "pre",
    "batch_size": 8,
    "grad_accum": 1,
    "lr": 6e-4,
    "min_lr": None,
    "warmup_steps": 100,
    "weight_decay": 0.1,
    "beta1": 0.9,
    "beta2": 0.95,
    "grad_clip": 1.0,
    "eval_interval": 250,
    "eval_iters": 20,
    "log_interval": 10,
    "sample_tokens": 48,
    "seed": 1337,
    "val_fraction": 0.1,
    "init_from": None,
    "resume": False,
    "save_dtype": "float32",
    "threads": None,
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line instead of usage + message
        raise TrainError(f"{message} (see --help)")


def build_parser() -> argparse.ArgumentParser:
    # Every default is SUPPRESS so that we can tell which flags were given: with --resume the
    # flags not given come from the saved run, then from DEFAULTS.
    p = _Parser(
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        argument_default=argparse.SUPPRESS,
    )
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
            raise TrainError(
                f"--init-from takes the architecture from the checkpoint; drop "
                f"--{clash[0].replace('_', '-')}"
            )
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
    for key in (
        "max_steps",
        "batch_size",
        "grad_accum",
        "eval_interval",
        "eval_iters",
        "log_interval",
        "n_layer",
        "n_head",
        "n_embd",
        "block_size",
    ):
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
        vocab_size=vocab_size,
        block_size=a.block_size,
        n_layer=a.n_layer,
        n_head=a.n_head,
        n_embd=a.n_embd,
        dropout=a.dropout,
        pos_encoding=a.pos_encoding,
        activation=a.activation,
        norm_position=a.norm_position,
    )


def arch(config: ModelConfig) -> dict[str, Any]:
    """The fields that make two configs the same model (dropout is a training choice)."""
    return {k: v for k, v in asdict(config).items() if k != "dropout"}
