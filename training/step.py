"""One optimizer update (with accumulation, clipping, DDP and scaler), the LR schedule, evaluation
and a short text sample."""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
import torch.nn as nn
from gptserve.model import GPT
from gptserve.model.tokenizers import Tokenizer
from gptserve.training.config import TrainConfig
from gptserve.training.data import BatchSampler
from torch.nn.parallel import DistributedDataParallel as DDP


class LossModule(nn.Module):
    """forward(x, y) -> loss, so that DDP and torch.compile see the whole training forward."""

    def __init__(self, model: GPT) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.model.loss(x, y)


def make_optimizer(
    model: nn.Module, lr: float, weight_decay: float, betas: tuple[float, float]
) -> torch.optim.AdamW:
    """AdamW with fused kernels; weight decay only on matrices (>= 2-D)."""
    params = [p for p in model.parameters() if p.requires_grad]  # tied weights appear once
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=1e-8, fused=True)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup over warmup_steps, then cosine decay to final_lr at max_steps."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if step >= cfg.max_steps:
        return cfg.final_lr
    ratio = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    return cfg.final_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg.lr - cfg.final_lr)


def train_step(
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    grad_clip: float,
    autocast: contextlib.AbstractContextManager | None = None,
    scaler: torch.amp.GradScaler | None = None,
) -> tuple[float, float, bool]:
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
    norm = float(
        torch.nn.utils.clip_grad_norm_(
            module.parameters(), grad_clip if grad_clip > 0 else math.inf
        )
    )
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
def evaluate(
    model: GPT,
    sampler: BatchSampler,
    iters: int,
    device: torch.device,
    autocast: contextlib.AbstractContextManager,
) -> float:
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
def sample_text(
    model: GPT, tok: Tokenizer, n_tokens: int, device: torch.device, seed: int,
    prompt: list[int] | None = None,
) -> str:  # fmt: skip
    """A short top-k sample from the token a document starts with (BOS where the tokenizer adds
    one, else end-of-text), or after `prompt` (a chat run's: the answer to one of its prompts),
    from a private generator (no global RNG use)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    start = tok.bos_token_id if tok.add_bos and tok.bos_token_id is not None else tok.eot_token
    idx = torch.tensor([prompt or [start]], device=device)
    given = idx.size(1)
    model.eval()
    for _ in range(n_tokens):
        logits = model(idx[:, -model.config.block_size :])[:, -1, :].float() / 0.8  # (1, V)
        top, where = torch.topk(logits, min(40, logits.size(-1)))
        choice = torch.multinomial(torch.softmax(top, dim=-1), 1, generator=gen)
        idx = torch.cat([idx, where.gather(-1, choice)], dim=1)
    model.train()
    return tok.decode(idx[0, given:].tolist())
