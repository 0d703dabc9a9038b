"""One deterministic training update under DDP, for test_train.py's equivalence test.

Run with `torchrun --nproc_per_node 2 tests/train/ddp_worker.py OUT.pt`. Every rank builds the
same model (same seed) and the same *global* batches (same generator); rank r trains on rows
[r * b, (r + 1) * b) of each micro-batch through training.step.train_step with DDP. Rank 0 saves the
weights and losses to OUT.pt; the test compares them with one process stepping on the full
global batches, which must give the same update (DDP averages the ranks' mean gradients).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from gptserve.model import GPT, ModelConfig
from gptserve.training.cli import leave
from gptserve.training.step import LossModule, make_optimizer, train_step
from torch.nn.parallel import DistributedDataParallel as DDP

CONFIG = ModelConfig(vocab_size=512, block_size=16, n_layer=2, n_head=2, n_embd=32)
GLOBAL_ROWS = 4  # rows per micro-batch over all ranks
MICRO_BATCHES = 2  # gradient accumulation inside each step
STEPS = 2


def global_batches() -> list[list[torch.Tensor]]:
    """STEPS x MICRO_BATCHES windows of (GLOBAL_ROWS, T + 1) tokens, the same on every rank."""
    g = torch.Generator().manual_seed(1234)
    return [
        [
            torch.randint(0, CONFIG.vocab_size, (GLOBAL_ROWS, CONFIG.block_size + 1), generator=g)
            for _ in range(MICRO_BATCHES)
        ]
        for _ in range(STEPS)
    ]


def fresh_model() -> GPT:
    torch.manual_seed(0)
    return GPT(CONFIG)


def rows(window: torch.Tensor, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    b = window.shape[0] // world
    part = window[rank * b : (rank + 1) * b]
    return part[:, :-1].contiguous(), part[:, 1:].contiguous()


def run(module: torch.nn.Module, model: GPT, rank: int, world: int) -> dict[str, object]:
    """STEPS updates; returns losses, gradient norms and the first step's (averaged) gradients.

    The gradients are compared as well as the weights because AdamW's update hardly depends on
    the gradients' scale: a sum-instead-of-mean bug would barely move the weights.
    """
    optimizer = make_optimizer(model, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.95))
    losses, norms, first_grads = [], [], {}
    for step in global_batches():
        loss, norm, applied = train_step(
            module, optimizer, [rows(w, rank, world) for w in step], grad_clip=1.0
        )
        assert applied
        losses.append(loss)
        norms.append(norm)
        if not first_grads:
            first_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return {"losses": losses, "norms": norms, "grads": first_grads}


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = fresh_model()
    result = run(DDP(LossModule(model)), model, rank, world)
    if rank == 0:
        torch.save({**result, "state": model.state_dict()}, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    leave(0)  # as train.py does under torchrun: no interpreter teardown
