"""The training run, top to bottom: set up, restore (--resume), then step, log, evaluate and
checkpoint until --max-steps."""

from __future__ import annotations

import math
import time
from typing import Any

import torch
import torch.nn as nn
from gptserve.model import get_tokenizer
from gptserve.model.cpu.malloc_tuning import retain_freed_memory
from gptserve.model.dtypes import DTYPES
from gptserve.training.chat_batches import (
    ChatBatchSampler,
    ChatData,
    chat_template_source,
    chat_val_loss,
    load_chat_data,
)
from gptserve.training.checkpointing import (
    BEST_DIR,
    STATE_FILE,
    atomic_torch_save,
    model_state,
    read_tokenizer_files,
    read_train_state,
    rng_state,
    save_merged,
    save_outputs,
    set_rng_state,
)
from gptserve.training.config import TrainConfig, model_flags
from gptserve.training.data import BatchSampler, data_fingerprint, prepare_data, split_tokens
from gptserve.training.distributed import (
    Dist,
    all_gather,
    on_every_rank,
    same_on_every_rank,
    wait_for_every_rank,
)
from gptserve.training.errors import TrainError
from gptserve.training.lora import load_lora_state, resolve_targets, trainable_count
from gptserve.training.metrics import (
    LOSS_PLOT,
    METRICS_FILE,
    append_metrics,
    plot_losses,
    trim_metrics,
)
from gptserve.training.setup import (
    autocast_for,
    build_model,
    load_run_tokenizer,
    pick_device,
    tokenizer_dir,
    train_window,
)
from gptserve.training.step import (
    LossModule,
    evaluate,
    lr_at,
    make_optimizer,
    sample_text,
    train_step,
)
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

MAX_BAD_STEPS = 5  # consecutive non-finite losses before training stops


def train(cfg: TrainConfig, info: Dist) -> None:
    out, save_dtype = cfg.out, DTYPES[cfg.save_dtype]

    # -------------------------------------------------------------------- process and device
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = on_every_rank(lambda: pick_device(cfg.device, info))
    if device.type == "cpu":
        retain_freed_memory()  # the logits alone are ~400 MB a step: reuse, don't page-fault
    autocast, scaler = autocast_for(cfg.dtype, device)

    # ---------------------------------------------------------------------------- data, model
    state = on_every_rank(lambda: read_train_state(out) if cfg.resume else None)
    same_on_every_rank(  # every rank reads train_state.pt itself
        "none" if state is None else f"step {state['step']}",
        f"runs in --out {out}",
        "every node must see --out on a shared filesystem",
    )
    vocab_size = get_tokenizer("gpt2").vocab_size
    model = on_every_rank(lambda: build_model(cfg, vocab_size, state))
    # The model's tokenizer: GPT-2's, or a checkpoint's own, whose files every checkpoint carries.
    tok_dir = tokenizer_dir(cfg, model.config)
    tok = on_every_rank(lambda: load_run_tokenizer(model.config, tok_dir))
    tokenizer_files = on_every_rank(lambda: read_tokenizer_files(tok_dir) if info.master else {})
    block_size = on_every_rank(lambda: train_window(cfg, model.config))
    chat: ChatData | None = None
    if cfg.chat:  # every rank reads and renders the examples itself (no cache)
        source = chat_template_source(cfg, model.config)
        vocab = model.config.vocab_size
        chat = on_every_rank(lambda: load_chat_data(cfg, source, tok, vocab, block_size))
        fingerprint = chat.fingerprint
    else:
        tokens = prepare_data(cfg.data, cfg.token_cache, info, model.config.tokenizer, tok_dir)
        fingerprint = data_fingerprint(tokens)
    if state is not None and state.get("data_fingerprint", fingerprint) != fingerprint:
        raise TrainError(
            f"--resume: --data {cfg.data} is not the data the run in {out} was trained on; "
            f"resume with that data, or train on this data with --init-from {out} --out NEW_DIR"
        )
    if chat is None:
        train_tokens, val_tokens = split_tokens(tokens, block_size, cfg.val_fraction)

    def make_sampler(seed: list[int]) -> BatchSampler | ChatBatchSampler:
        if chat is not None:
            return ChatBatchSampler(chat.train, cfg.batch_size, seed, tok.eot_token)
        return BatchSampler(train_tokens, block_size, cfg.batch_size, seed)

    model.to(device)
    optimizer = make_optimizer(model, cfg.lr, cfg.weight_decay, (cfg.beta1, cfg.beta2))
    sampler = make_sampler([cfg.seed, info.rank])
    torch.manual_seed(cfg.seed + info.rank)  # dropout masks differ across ranks
    step, best_val = 0, math.inf

    # --------------------------------------------------------------------------------- resume
    if state is not None:
        if cfg.lora_rank is not None:
            load_lora_state(model, state["model"])  # the base is --init-from's, as it was
        else:
            model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        if scaler is not None and state.get("scaler"):
            scaler.load_state_dict(state["scaler"])
        step, best_val = state["step"], state["best_val"]
        if len(state["ranks"]) == info.world:  # each rank continues its own batches and RNG
            sampler.load_state_dict(state["ranks"][info.rank]["sampler"])
            set_rng_state(state["ranks"][info.rank]["rng"])
        else:  # another world size: fresh per-rank streams, derived from the step
            sampler = make_sampler([cfg.seed, info.rank, step])
            torch.manual_seed(cfg.seed + info.rank + step)
        del state
    metrics = out / METRICS_FILE
    if info.master:
        out.mkdir(parents=True, exist_ok=True)
        if cfg.resume:
            trim_metrics(metrics, step)  # keep the lines up to the checkpoint, append after them
        else:
            metrics.unlink(missing_ok=True)
    # The flags saved with the run: the architecture is the model's (--init-from brings its own),
    # block_size the training window.
    saved_flags = {**cfg.to_dict(), **model_flags(model.config), "block_size": block_size}

    train_module: nn.Module = LossModule(model)  # DDP and torch.compile see forward + loss
    if cfg.compile:
        train_module.compile()
    if info.world > 1:
        ids = [device.index] if device.type == "cuda" else None
        train_module = DDP(train_module, device_ids=ids)
    tokens_per_step = cfg.batch_size * cfg.grad_accum * block_size * info.world
    if info.master:
        mc = model.config
        heads = f"{mc.n_head} heads" + (
            f" ({mc.kv_heads} key/value)" if mc.kv_heads != mc.n_head else ""
        )
        if chat is not None:
            data = f"{chat.summary()}; {cfg.batch_size * cfg.grad_accum * info.world} examples/step"
        else:
            n_val = 0 if val_tokens is None else len(val_tokens)
            data = (
                f"data: {len(train_tokens):,} train / {n_val:,} val tokens; "
                f"{tokens_per_step:,} tokens/step"
            )
        print(
            f"model: {model_flags(mc)['arch']}, {model.num_params() / 1e6:.2f}M parameters, "
            f"{mc.n_layer} layers, {heads}, width {mc.n_embd}, block {block_size}; "
            f"{data} on {info.world} x {device.type}",
            flush=True,
        )
        if cfg.lora_rank is not None:
            targets = resolve_targets(cfg.lora_targets, mc)
            print(
                f"LoRA: rank {cfg.lora_rank}, alpha {cfg.alpha:g} on {','.join(targets)}; "
                f"{trainable_count(model):,} trainable parameters, the base frozen",
                flush=True,
            )
    if step >= cfg.max_steps:
        if info.master:
            print(f"already at step {step} >= --max-steps {cfg.max_steps}; nothing to do")
            if cfg.merge:
                print(f"merged checkpoint: {save_merged(model, cfg, save_dtype, tokenizer_files)}")
        return

    # ----------------------------------------------------------------------------------- loop
    bar = tqdm(
        total=cfg.max_steps, initial=step, unit="step", disable=not info.master, dynamic_ncols=True
    )
    bad_steps = 0
    while step < cfg.max_steps:
        t0 = time.perf_counter()
        lr = lr_at(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batches = [
            tuple(t.to(device, non_blocking=True) for t in sampler.next())
            for _ in range(cfg.grad_accum)
        ]
        loss, norm, applied = train_step(
            train_module, optimizer, batches, cfg.grad_clip, autocast, scaler
        )
        step += 1
        bad_steps = 0 if applied else bad_steps + 1
        if bad_steps >= MAX_BAD_STEPS:  # the loss is all-reduced: every rank stops here
            raise TrainError(
                f"loss or gradient not finite for {bad_steps} consecutive steps (last at step "
                f"{step}); weights were not updated by them; the last checkpoint is intact; "
                f"try a lower --lr or --dtype float32",
                exit_code=1,
            )
        if not applied:
            bar.write(f"step {step}: non-finite loss/gradient ({loss}, {norm}); step skipped")
        if chat is not None:  # rows are padded to each batch's longest
            step_tokens = sum(x.numel() for x, _ in batches) * info.world
        else:
            step_tokens = tokens_per_step
        tok_s = step_tokens / max(time.perf_counter() - t0, 1e-9)
        bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tok_s:,.0f}", refresh=False)
        bar.update(1)

        # evaluate, log, checkpoint
        row: dict[str, Any] = {
            "step": step,
            "train_loss": loss,
            "lr": lr,
            "tokens_per_s": round(tok_s, 1),
        }
        if not applied:
            row["skipped"] = True
        is_eval = step % cfg.eval_interval == 0 or step == cfg.max_steps
        val_loss = None
        if is_eval and chat is not None and chat.val:
            val_loss = chat_val_loss(
                model, chat.val, cfg.batch_size, cfg.eval_iters, tok.eot_token, device,
                autocast, info,
            )  # fmt: skip
            row["val_loss"] = val_loss
        elif is_eval and chat is None and val_tokens is not None:
            # a fresh sampler each time: the same batches at every eval
            val_sampler = BatchSampler(
                val_tokens, block_size, cfg.batch_size, [cfg.seed, info.rank, 1]
            )
            val_loss = evaluate(model, val_sampler, cfg.eval_iters, device, autocast)
            row["val_loss"] = val_loss
        # The row goes to disk before the checkpoint: a kill in between resumes from the
        # previous checkpoint and drops the row, never losing one that the checkpoint covers.
        if info.master and (is_eval or step % cfg.log_interval == 0):
            append_metrics(metrics, row)
        if not is_eval:
            continue
        improved = val_loss is not None and val_loss < best_val
        if improved:
            best_val = val_loss
        ranks = all_gather({"sampler": sampler.state_dict(), "rng": rng_state()})
        if info.master:
            save_outputs(model, cfg, out, save_dtype, tokenizer_files)
            if improved:
                save_outputs(model, cfg, out / BEST_DIR, save_dtype, tokenizer_files)
            train_state = {
                "version": 1,
                "step": step,
                "best_val": best_val,
                "args": saved_flags,
                "config": model.config.to_dict(),
                "model": model_state(model, cfg),  # a LoRA run's pairs only
                "optimizer": optimizer.state_dict(),
                "scaler": scaler.state_dict() if scaler is not None else None,
                "ranks": ranks,
                "data_fingerprint": fingerprint,
            }
            atomic_torch_save(train_state, out / STATE_FILE)
            plot_losses(metrics, out / LOSS_PLOT)
            prompt = chat.sample_prompt if chat is not None else None
            text = sample_text(model, tok, cfg.sample_tokens, device, cfg.seed, prompt)
            msg = f"step {step}: train {loss:.4f}"
            msg += f", val {val_loss:.4f}" if val_loss is not None else ""
            bar.write(msg + (f" | sample: {text!r}" if text else ""))
    bar.close()
    if info.master:
        best = f", best val loss {best_val:.4f} in {out / BEST_DIR}" if best_val < math.inf else ""
        print(f"done: {step} steps; checkpoint in {out}{best}")
        if cfg.merge:
            print(f"merged checkpoint: {save_merged(model, cfg, save_dtype, tokenizer_files)}")
    wait_for_every_rank()  # no rank leaves the process group while rank 0 still writes
