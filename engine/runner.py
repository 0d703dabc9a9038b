"""The model runner: a `StepPlan` in, the step's logits rows out.

It owns the KV cache's memory and attention (`kernels.paged_kv.KVPools`). Given the plan and
what the block bookkeeping prepared for it (`engine.block_manager.StepBlocks`: the step's
attention metadata and the block copies to make first), it makes the copies, packs the plan's
new tokens into one tensor and runs the model's one forward, asking only for the rows the plan
needs (and the final hidden states of an embedding's rows). What the logits mean (draw, verify,
score) is the engine's business. With LoRA slots (`model.lora.batched`), each packed row is
named its sequence's adapter slot first (`LoraBank.set_step`); the products' wrappers, or the
one-call layers that take the step's updates themselves (`model.cpu.one_call_block`), apply
them.
"""

from __future__ import annotations

import torch
from gptserve.engine.block_manager import StepBlocks
from gptserve.engine.step_plan import StepPlan
from gptserve.kernels.paged_kv import KVPools
from gptserve.model.gpt import GPT
from gptserve.model.lora.batched import BASE_SLOT, LoraBank


class ModelRunner:
    """Runs one model over its KV pools, a step at a time."""

    def __init__(self, model: GPT, pools: KVPools, lora: LoraBank | None = None) -> None:
        self.model = model
        self.pools = pools
        self.lora = lora
        self.device = next(model.parameters()).device

    def run(self, plan: StepPlan, blocks: StepBlocks) -> torch.Tensor:
        """The logits (len(plan.logits_positions), V) of the plan's step, on the model's device;
        raises what the forward raises."""
        return self.run_step(plan, blocks)[0]

    def run_step(
        self, plan: StepPlan, blocks: StepBlocks
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step's logits (len(plan.logits_positions), V) and, when the plan has embedding
        rows, the final hidden states after the final norm (len(plan.hidden_positions), C),
        from one forward; raises what the forward raises."""
        self.pools.copy_blocks(blocks.copies)
        if self.lora is None or all(s.seq.lora_slot == BASE_SLOT for s in plan.scheduled):
            return self._forward(plan, blocks)  # no adapter rows: nothing to name
        row_slots = [s.seq.lora_slot for s in plan.scheduled for _ in range(s.num_tokens)]
        try:
            self.lora.set_step(row_slots, self.device)
            return self._forward(plan, blocks)
        finally:
            self.lora.clear_step()

    def _forward(
        self, plan: StepPlan, blocks: StepBlocks
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        tokens = [t for s in plan.scheduled for t in s.input_ids()]  # (num_tokens,)

        def index(positions: list[int]) -> torch.Tensor:
            return torch.tensor(positions, dtype=torch.long, device=self.device)

        with torch.inference_mode():
            args = (torch.tensor(tokens, device=self.device), self.pools, blocks.meta)
            logits_index = index(plan.logits_positions)
            if not plan.hidden_positions:
                return self.model.forward_cached(*args, logits_index=logits_index), None
            return self.model.forward_cached(
                *args, logits_index=logits_index, hidden_index=index(plan.hidden_positions)
            )  # (len(logits_positions), V), (len(hidden_positions), C)
