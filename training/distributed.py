"""Ranks under torchrun: joining the process group, and running a part of the run on rank 0 or on
every rank so that a TrainError on any rank stops all of them with one message (rank 0 prints it)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from gptserve.training.errors import TrainError

T = TypeVar("T")

SHARED_STORE_WARNING = (
    "torchrun shares its rendezvous store with the workers, so after a restart a rank can read "
    "the previous round's addresses and fail to connect (pytorch/pytorch#135712); start torchrun "
    "with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 when it may restart workers (--max-restarts)"
)


def shared_store_breaks_restarts(env: Mapping[str, str]) -> bool:
    """Whether torchrun may restart these workers while they share its rendezvous store."""
    restarts = int(env.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)
    return restarts > 0 and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def master(self) -> bool:
        return self.rank == 0


def join_process_group() -> Dist:
    """Under torchrun (RANK and WORLD_SIZE set) join the process group; else one process."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return Dist()
    info = Dist(
        int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    )
    if info.world > 1 and not dist.is_initialized():
        if info.rank == 0 and shared_store_breaks_restarts(os.environ):
            print(f"warning: {SHARED_STORE_WARNING}", file=sys.stderr)
        # gloo carries CPU tensors (and the small objects below), NCCL the CUDA ones.
        dist.init_process_group("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
    return info


def all_gather(obj: Any) -> list[Any]:
    """Every rank's `obj`, on every rank (a list of one outside torchrun)."""
    if not dist.is_initialized():
        return [obj]
    objs: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(objs, obj)
    return objs


def wait_for_every_rank() -> None:
    """Return once every rank got here (a barrier over the CPU group)."""
    all_gather(None)


def on_rank0(fn: Callable[[], T], info: Dist) -> T:
    """fn() on rank 0 only; its result, or the TrainError it raised, on every rank."""
    box: list[Any] = [None]
    if info.master:
        try:
            box = [(fn(), None)]
        except TrainError as exc:
            box = [(None, (str(exc), exc.exit_code))]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    result, error = box[0]
    if error is not None:
        raise TrainError(*error)
    return result


def on_every_rank(fn: Callable[[], T]) -> T:
    """fn() on every rank; a TrainError on any rank is raised on all of them (the lowest failing
    rank's message, prefixed with its rank when rank 0 did not fail)."""
    try:
        result, error = fn(), None
    except TrainError as exc:
        result, error = None, (str(exc), exc.exit_code)
    for rank, failed in enumerate(all_gather(error)):
        if failed is not None:
            message, code = failed
            raise TrainError(message if rank == 0 else f"rank {rank}: {message}", code)
    return result


def same_on_every_rank(value: object, what: str, hint: str) -> None:
    """Raise the same TrainError on every rank unless all ranks hold an equal `value`."""
    values = all_gather(value)
    if any(v != values[0] for v in values):
        seen = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
        raise TrainError(f"the ranks see different {what} ({seen}); {hint}")
