"""merge_into adds scaling * B @ A into the rows of each piece's layer (and takes it back out)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from gptserve.model.lora.adapter import LoraAdapter, LoraPiece
from gptserve.model.lora.merge import merge_into


def test_merged_layer_computes_the_low_rank_update_on_its_slice() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 12))
    piece = LoraPiece(a=torch.randn(2, 8), b=torch.randn(4, 2), offset=5)
    adapter = LoraAdapter("t", rank=2, alpha=3.0, scaling=1.5, pieces={"0": [piece]})
    x = torch.randn(3, 8)
    with torch.no_grad():
        expected = model(x)
        expected[:, 5:9] += 1.5 * (x @ piece.a.T) @ piece.b.T  # the LoRA forward, unmerged
        before = model[0].weight.clone()
        merge_into(model, adapter)
        assert (model(x) - expected).abs().max() < 1e-5
        merge_into(model, adapter, sign=-1.0)
        assert (model[0].weight - before).abs().max() < 1e-6


def test_pieces_that_do_not_fit_or_name_no_linear_are_refused() -> None:
    model = nn.Sequential(nn.Linear(8, 12), nn.ReLU())
    too_far = LoraPiece(a=torch.zeros(2, 8), b=torch.zeros(4, 2), offset=10)
    with pytest.raises(ValueError, match="does not fit"):
        merge_into(model, LoraAdapter("t", 2, 2.0, 1.0, {"0": [too_far]}))
    with pytest.raises(ValueError, match="not a plain Linear"):
        merge_into(model, LoraAdapter("t", 2, 2.0, 1.0, {"1": [too_far]}))
    with pytest.raises(ValueError, match="no layer"):
        merge_into(model, LoraAdapter("t", 2, 2.0, 1.0, {"2": [too_far]}))
