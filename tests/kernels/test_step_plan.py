"""The per-step plan cache the CPU attention paths share."""

from __future__ import annotations

import torch

from kernels.step_plan import StepPlanCache


def test_a_plan_is_reused_only_for_the_same_unchanged_tensors_and_key():
    cache: StepPlanCache[int] = StepPlanCache()
    builds = []

    def build() -> int:
        builds.append(1)
        return len(builds)

    a, b = torch.zeros(3), torch.ones(2)
    assert cache.get((a, b), "k", build) == 1
    assert cache.get((a, b), "k", build) == 1  # another layer of the same step
    assert cache.get((a, b), "other key", build) == 2
    a.add_(1)  # changed in place: its version moved
    assert cache.get((a, b), "other key", build) == 3
    assert cache.get((a.clone(), b), "other key", build) == 4  # equal values, another object
    cache.clear()
    assert cache.plan is None and not cache.built


def test_a_none_plan_is_cached_and_inference_tensors_always_rebuild():
    cache: StepPlanCache[None] = StepPlanCache()
    calls = []
    t = torch.zeros(2)
    cache.get((t,), 0, lambda: calls.append(1))
    cache.get((t,), 0, lambda: calls.append(1))
    assert calls == [1]  # "no plan for this step" is an answer worth keeping too
    with torch.inference_mode():
        frozen = torch.zeros(2)  # no version counter: an in-place change could go unseen
    cache.get((frozen,), 0, lambda: calls.append(1))
    cache.get((frozen,), 0, lambda: calls.append(1))
    assert calls == [1, 1, 1]
