"""The training run: set up, restore (--resume), then step, log, evaluate and checkpoint."""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

import kernels
from model import get_tokenizer
from model.cpu_memory import retain_freed_memory
from training.args import DTYPES, model_config
from training.data import BatchSampler, prepare_data, split_tokens
from training.errors import TrainError
from training.metrics import append_metrics, plot_losses, trim_metrics
from training.setup import autocast_for, build_model, check_out_dir, setup_device
from training.state import (
    BEST_DIR,
    METRICS_FILE,
    STATE_FILE,
    atomic_torch_save,
    gather_rank_states,
    read_train_state,
    save_served,
    set_rng_state,
)
from training.step import LossModule, evaluate, lr_at, make_optimizer, sample_text, train_step

MAX_BAD_STEPS = 5  # consecutive non-finite losses before training stops


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
            sampler = BatchSampler(
                train_tokens, model.config.block_size, a.batch_size, [a.seed, info.rank, step]
            )
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
        train_module = DDP(
            train_module, device_ids=[device.index] if device.type == "cuda" else None
        )
    tokens_per_step = a.batch_size * a.grad_accum * model.config.block_size * info.world
    if info.master:
        print(
            f"model: {model.num_params() / 1e6:.2f}M parameters, {model.config.n_layer} layers, "
            f"{model.config.n_head} heads, width {model.config.n_embd}, block "
            f"{model.config.block_size}; data: {len(train_tokens):,} train / "
            f"{0 if val_tokens is None else len(val_tokens):,} val tokens; {tokens_per_step:,} "
            f"tokens/step on {info.world} x {device.type}",
            flush=True,
        )
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
        atomic_torch_save(
            {
                "version": 1,
                "step": step,
                "best_val": best_val,
                "args": vars(a),
                "config": model.config.to_dict(),
                "model": {k: v.detach().cpu() for k, v in model.state_dict().items()},
                "optimizer": optimizer.state_dict(),
                "scaler": scaler.state_dict() if scaler is not None else None,
                "ranks": rank_states,
            },
            out / STATE_FILE,
        )

    bar = tqdm(
        total=a.max_steps, initial=step, unit="step", disable=not info.master, dynamic_ncols=True
    )
    bad_steps = 0
    while step < a.max_steps:
        t0 = time.perf_counter()
        lr = lr_at(step, a)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batches = [
            tuple(t.to(device, non_blocking=True) for t in sampler.next())
            for _ in range(a.grad_accum)
        ]
        loss, norm, applied = train_step(
            train_module, optimizer, batches, a.grad_clip, autocast, scaler
        )
        step += 1
        bad_steps = 0 if applied else bad_steps + 1
        if bad_steps >= MAX_BAD_STEPS:
            raise TrainError(
                f"loss or gradient not finite for {bad_steps} consecutive steps (last at step "
                f"{step}); weights were not updated by them; the last checkpoint is intact; "
                f"try a lower --lr or --dtype float32",
                exit_code=1,
            )
        if not applied:
            bar.write(f"step {step}: non-finite loss/gradient ({loss}, {norm}); step skipped")
        elapsed = time.perf_counter() - t0
        tok_s = tokens_per_step / max(elapsed, 1e-9)
        bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tok_s:,.0f}", refresh=False)
        bar.update(1)
        row: dict[str, Any] = {
            "step": step,
            "train_loss": loss,
            "lr": lr,
            "tokens_per_s": round(tok_s, 1),
        }
        if not applied:
            row["skipped"] = True
        is_eval = step % a.eval_interval == 0 or step == a.max_steps
        val_loss = None
        if is_eval and val_tokens is not None:
            val_sampler = BatchSampler(
                val_tokens, model.config.block_size, a.batch_size, [a.seed, info.rank, 1]
            )
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
                text = (
                    sample_text(model, a.sample_tokens, device, a.seed) if a.sample_tokens else ""
                )
                msg = f"step {step}: train {loss:.4f}"
                msg += f", val {val_loss:.4f}" if val_loss is not None else ""
                bar.write(msg + (f" | sample: {text!r}" if text else ""))
    bar.close()
    if info.master:
        print(
            f"done: {step} steps; checkpoint in {out}"
            + (f", best val loss {best_val:.4f} in {out / BEST_DIR}" if best_val < math.inf else "")
        )
