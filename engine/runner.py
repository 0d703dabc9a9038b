"""The model runner: a `StepPlan` in, the step's logits rows out.

It packs the plan's new tokens into one tensor, reserves their KV cache room and describes the
step to attention (`KVCache.prepare`), and runs the model's one forward, asking only for the rows
the plan needs. What the logits mean (draw, verify, score) is the engine's business.
"""

from __future__ import annotations

import torch

from engine.kv_cache import KVCache
from engine.step_plan import StepPlan
from model.gpt import GPT


class ModelRunner:
    """Runs one model over one paged KV cache, a step at a time."""

    def __init__(self, model: GPT, cache: KVCache) -> None:
        self.model = model
        self.cache = cache
        self.device = next(model.parameters()).device

    def run(self, plan: StepPlan) -> torch.Tensor:
        """The logits (len(plan.logits_positions), V) of the plan's step, on the model's device.

        Raises OutOfBlocks, with the cache unchanged, if the cache cannot hold the step (the
        scheduler plans within the free blocks, so this means a bug), or what the forward raises.
        """
        meta = self.cache.prepare([(s.seq.seq_id, s.num_tokens) for s in plan.scheduled])
        tokens = [t for s in plan.scheduled for t in s.input_ids()]  # (num_tokens,)
        with torch.inference_mode():
            return self.model.forward_cached(
                torch.tensor(tokens, device=self.device),
                self.cache,
                meta,
                logits_index=torch.tensor(
                    plan.logits_positions, dtype=torch.long, device=self.device
                ),
            )  # (len(plan.logits_positions), V)
