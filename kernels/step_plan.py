"""One plan per model step: what depends only on the batch layout, built by the first layer.

The layers of one engine step pass the very same block-table, context-length and query-start
tensors, so a CPU attention path can work out which blocks to read, the masks and the like once,
and every later layer reuses it. A plan is rebuilt when those tensors are other objects, were
changed in place (their version counters moved), or are inference tensors (which have no version
counter, so a change could go unseen).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

import torch

Plan = TypeVar("Plan")


class StepPlanCache(Generic[Plan]):
    """Keeps the last plan with the batch tensors and the key it was built for."""

    def __init__(self) -> None:
        self.inputs: tuple[torch.Tensor, ...] = ()  # kept alive, so ids cannot be reused
        self.versions: tuple[int, ...] = ()
        self.key: Hashable = None
        self.built = False
        self.plan: Plan | None = None

    def get(
        self, inputs: tuple[torch.Tensor, ...], key: Hashable, build: Callable[[], Plan]
    ) -> Plan:
        """The plan for these batch tensors and key (shapes, sizes), built if it is not the last."""
        fresh = (
            self.built
            and not any(t.is_inference() for t in inputs)
            and len(inputs) == len(self.inputs)
            and all(a is b for a, b in zip(self.inputs, inputs))
            and self.versions == tuple(t._version for t in inputs)
            and self.key == key
        )
        if not fresh:
            self.plan = build()
            self.built = True
            self.inputs = inputs
            self.versions = tuple(-1 if t.is_inference() else t._version for t in inputs)
            self.key = key
        return self.plan

    def clear(self) -> None:
        self.__init__()
