"""What the one-call decode layers share: a `Block` that keeps another's children, and the swap.

`model.cpu.decode_layer` (GPT-2) and `model.cpu.llama_layer` (the Llama family) each make a layer
whose decode step is one compiled call; such a layer is the block it replaces, children and all
(its prefill and every step the call does not suit take the block's own forward), built by
`install_one_call_blocks` in place of each layer that fits. With LoRA slots (`install_lora`), a
step's adapter updates of the layer go into the call (`lora_updates`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch.nn as nn
from gptserve.model.gpt import Block
from gptserve.model.lora.batched import LoraBank, OneCallUpdates


class OneCallBlock(Block):
    """`block`'s children and forward; a subclass adds the compiled call of a decode step."""

    lora_bank: LoraBank | None = None  # the model's adapter slots (`install_lora` sets them)

    def __init__(self, block: Block) -> None:
        nn.Module.__init__(self)
        self.pre_norm = block.pre_norm
        for name, child in block.named_children():
            self.add_module(name, child)

    def lora_updates(self, layer: int) -> OneCallUpdates | None:
        """This step's LoRA adapter updates of this layer as the call takes them (lora_meta,
        lora_weights; both empty: none), or None where it cannot take them (the step then runs
        the block's forward, whose products apply them)."""
        bank = self.lora_bank
        if bank is None or not bank.active:
            return [], []
        return bank.one_call_updates(layer)


def install_one_call_blocks(
    model: nn.Module, fits: Callable[[nn.Module], bool], make: Callable[[Block], OneCallBlock]
) -> int:
    """Replace each layer of `model` that `fits` by `make(layer)`, in place; returns how many."""
    layers = model.transformer.h
    changed = 0
    for i, block in enumerate(layers):
        if fits(block):
            layers[i] = make(block)
            changed += 1
    return changed
