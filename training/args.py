"""Train a GPT on UTF-8 text; the output directory is directly servable (`gptserve serve --model DIR`).

    gptserve train --data shakespeare.txt --out runs/shakespeare --max-steps 2000
    gptserve train --out runs/shakespeare --resume            # continue a killed run
    gptserve train --data ... --out ... --resume auto         # continue it if there is one
    gptserve train --data ... --out runs/shakespeare --overwrite  # start that run over
    torchrun --nproc_per_node 2 train.py --data ... --out ...  # DistributedDataParallel
    gptserve train --arch llama --data ... --out ...          # a Llama-shaped model
    gptserve train --init-from DIR --data ... --out ...       # fine-tune DIR (ours or HF)
    gptserve train --init-from DIR --lora-rank 8 --data ... --out ...  # a LoRA adapter on DIR
    gptserve train --init-from DIR --data chats.jsonl --out ...  # chat fine-tuning (also LoRA)

Writes into DIR: config.json + model.safetensors (last), best/ (lowest validation loss),
train_state.pt (everything --resume needs, full fp32 weights included), metrics.jsonl, loss.png
and cache/ (the tokenized data); a model with its own tokenizer also gets its tokenizer.json
(and tokenizer_config.json, generation_config.json, chat_template.jinja). A LoRA run writes a
PEFT adapter instead of the model (adapter_config.json + adapter_model.safetensors, in DIR and
best/) and keeps only the adapter in train_state.pt; --merge adds DIR/merged, a servable
checkpoint of the base with the adapter added in. See docs/TRAINING.md.
"""

from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path
from typing import Any

from gptserve.model.dtypes import DTYPES
from gptserve.model.lora.peft_format import CONFIG_FILE as ADAPTER_FILE
from gptserve.training.checkpointing import STATE_FILE, read_saved_flags
from gptserve.training.config import (
    ARCH_KEYS,
    ARCHS,
    GPT2_ONLY_KEYS,
    LLAMA_ONLY_KEYS,
    LORA_KEYS,
    PATH_KEYS,
    TrainConfig,
    field_names,
    flag,
)
from gptserve.training.errors import TrainError


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line instead of usage + message
        raise TrainError(f"{message} (see --help)")


def _resume_mode(text: str) -> str:
    if text != "auto":
        raise argparse.ArgumentTypeError(f"--resume takes no value or 'auto', got {text!r}")
    return text


def _targets(text: str) -> tuple[str, ...]:
    return tuple(t.strip() for t in text.split(",") if t.strip())


def build_parser() -> argparse.ArgumentParser:
    # Every default is SUPPRESS so that we can tell which flags were given: with --resume the
    # flags not given come from the saved run, then from TrainConfig's defaults.
    p = _Parser(
        prog="gptserve train",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        argument_default=argparse.SUPPRESS,
    )
    a = p.add_argument
    a(
        "--data",
        help="UTF-8 text file or folder of .txt files, or a .jsonl file of chat examples "
        "(OpenAI's fine-tuning format; see docs/TRAINING.md)",
    )
    a("--chat-data", action="store_true", help="--data is chat examples whatever its name")
    a("--val-data", help="chat: a .jsonl file of validation examples (else --val-fraction)")
    a("--out", help="output directory (checkpoints, metrics)")
    a("--cache-dir", help="where tokenized data is cached (default: OUT/cache)")
    a("--max-steps", type=int, help="total optimizer steps (default 5000)")
    a("--device", choices=["auto", "cpu", "cuda"])
    a("--dtype", choices=["auto", *DTYPES], help="autocast dtype (auto: bf16 on CUDA, fp32 on CPU)")
    a("--compile", action="store_true", help="torch.compile the training step")
    g = p.add_argument_group("model")
    g.add_argument(
        "--arch",
        choices=list(ARCHS),
        help="gpt2 (default) or llama: rotary positions, RMSNorm, SwiGLU, no biases",
    )
    for name in ("--n-layer", "--n-head", "--n-embd"):
        g.add_argument(name, type=int)
    g.add_argument(
        "--block-size",
        type=int,
        help="context length (default 256); with --init-from the training window (default: "
        "the checkpoint's context length, at most 1024)",
    )
    g.add_argument("--dropout", type=float)
    g.add_argument("--pos-encoding", choices=["learned", "sinusoidal"], help="gpt2 only")
    g.add_argument("--activation", choices=["gelu", "relu"], help="gpt2 only")
    g.add_argument("--norm-position", choices=["pre", "post"], help="gpt2 only")
    g.add_argument("--n-kv-head", type=int, help="llama: key/value heads (default: --n-head)")
    g.add_argument("--rope-theta", type=float, help="llama: rotary base (default 10000)")
    g.add_argument("--qk-norm", action="store_true", help="llama: RMSNorm of q and k (Qwen3)")
    g.add_argument("--head-size", type=int, help="width of a head (default n-embd / n-head)")
    g.add_argument(
        "--intermediate-size",
        type=int,
        help="MLP width (default: 4 x n-embd; llama: 8/3 x n-embd rounded up to 64)",
    )
    g.add_argument(
        "--tie-embeddings",
        action=argparse.BooleanOptionalAction,
        help="lm_head shares the token embedding (default: tied)",
    )
    g.add_argument(
        "--init-from",
        help="start from a checkpoint dir (ours, or Hugging Face GPT-2, Llama, Mistral, Qwen2, "
        "Qwen3): its architecture and tokenizer",
    )
    lo = p.add_argument_group("LoRA: train an adapter on the frozen --init-from model")
    lo.add_argument("--lora-rank", type=int, help="train a LoRA adapter of this rank")
    lo.add_argument("--lora-alpha", type=float, help="scaling is alpha / rank (default 2 x rank)")
    lo.add_argument(
        "--lora-targets",
        type=_targets,
        help="comma-separated projections among q,k,v,o,gate,up,down, or 'all' (default: q,v "
        "for the Llama family, q,k,v (c_attn) for GPT-2)",
    )
    lo.add_argument("--lora-dropout", type=float, help="dropout on the adapter's input (default 0)")
    lo.add_argument(
        "--merge",
        action="store_true",
        help="also write OUT/merged: a checkpoint of the base with the adapter added in",
    )
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
    e.add_argument(
        "--resume",
        nargs="?",
        const=True,
        type=_resume_mode,
        metavar="auto",
        help="continue the run in --out; 'auto': continue it if there is one, else start",
    )
    e.add_argument(
        "--overwrite",
        action="store_true",
        help="start over in an --out that holds a run or a model (without it, that is an error)",
    )
    return p


def _check_out_is_free(out: Path) -> None:
    """A new run never replaces what --out holds by accident: a run (train_state.pt) or a model."""
    if (out / STATE_FILE).is_file():
        held = "a run"
    elif (out / "config.json").is_file():
        held = "a model"
    elif (out / ADAPTER_FILE).is_file():
        held = "an adapter"
    else:
        return
    raise TrainError(
        f"--out {out} holds {held}; --resume continues it, --overwrite starts over in it, or "
        "choose another --out"
    )


def _check_arch_flags(given: dict[str, Any]) -> None:
    """Refuse a flag that the chosen --arch has no use for, rather than ignore it."""
    arch = given.get("arch", "gpt2")
    wrong = LLAMA_ONLY_KEYS if arch == "gpt2" else GPT2_ONLY_KEYS
    for key in wrong:
        if key in given:
            need = "--arch llama" if arch == "gpt2" else "--arch gpt2"
            raise TrainError(f"--{flag(key)} needs {need} (this run is --arch {arch})")


def _same_lora(given: dict[str, Any], saved: dict[str, Any]) -> str:
    """A LoRA run's --resume keeps its adapter's shape, scaling and base: the saved base."""
    for key in LORA_KEYS:
        was, now = saved.get(key), given.get(key)
        if key == "init_from" and now is not None:
            now = str(Path(now).resolve())
        if key in given and now != was:
            raise TrainError(
                f"--out {given['out']} holds a LoRA run with {key}={was}; --resume cannot change "
                f"it to {now}"
            )
    return saved["init_from"]


def parse_config(argv: list[str] | None) -> TrainConfig:
    """Parse argv into the run's TrainConfig. With --resume, the flags not given come from the
    saved run (architecture flags cannot change), then from TrainConfig's defaults."""
    given: dict[str, Any] = vars(build_parser().parse_args(argv))
    if not given.get("out"):
        raise TrainError("--out DIR is required")
    mode = given.pop("resume", None)
    overwrite = given.pop("overwrite", False)
    if mode is not None and overwrite:
        raise TrainError(
            "--resume continues the run in --out and --overwrite starts over: not both"
        )
    resume = mode is True or (mode == "auto" and (Path(given["out"]) / STATE_FILE).is_file())
    if not resume and not overwrite:
        _check_out_is_free(Path(given["out"]))
    settings: dict[str, Any] = {}
    if resume:
        saved = read_saved_flags(Path(given["out"]))
        defaults = {f.name: f.default for f in fields(TrainConfig)}  # runs saved before a flag
        for key in ARCH_KEYS:
            was = saved.get(key, defaults[key])
            if key in given and given[key] != was:
                raise TrainError(
                    f"--out {given['out']} holds a model with {key}={was}; --resume cannot "
                    f"change it to {given[key]}"
                )
        settings.update({k: v for k, v in saved.items() if k in field_names()})
        settings["init_from"] = None  # the weights come from the training state
        if saved.get("lora_rank"):  # but a LoRA run's base stays where it was
            settings["init_from"] = _same_lora(given, saved)
        elif given.get("lora_rank"):
            raise TrainError(
                f"--out {given['out']} holds a full training run; --lora-rank cannot be added on "
                f"--resume (train an adapter on it with --init-from {given['out']} --out NEW_DIR)"
            )
    elif given.get("init_from"):
        if given.get("lora_rank"):  # the adapter names its base; --resume reloads it from there
            given["init_from"] = str(Path(given["init_from"]).resolve())
        clash = [k for k in ARCH_KEYS if k in given and k != "block_size"]
        if clash:
            raise TrainError(
                f"--init-from takes the architecture from the checkpoint; drop --{flag(clash[0])}"
            )
    else:
        _check_arch_flags(given)
    settings.update(given)
    settings["resume"] = resume
    if not settings.get("data"):
        raise TrainError("--data PATH is required")
    for key in PATH_KEYS:
        settings[key] = Path(settings[key]) if settings.get(key) else None
    return TrainConfig(**settings)
