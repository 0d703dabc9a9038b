"""What the one-call decode layers share: a `Block` that keeps another's children, and the swap.

`model.cpu.decode_layer` (GPT-2) and `model.cpu.llama_layer` (the Llama family) each make a layer
whose decode step is one compiled call; such a layer is the block it replaces, children and all
(its prefill and every step the call does not suit take the block's own forward), built by
`install_one_call_blocks` in place of each layer that fits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.nn as nn

from model.gpt import Block


class OneCallBlock(Block):
    """`block`'s children and forward; a subclass adds the compiled call of a decode step."""

    def __init__(self, block: Block) -> None:
        nn.Module.__init__(self)
        self.pre_norm = block.pre_norm
        for name, child in block.named_children():
            self.add_module(name, child)


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
