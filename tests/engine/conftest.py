"""Fixtures the engine's tests share: GPT-2's tokenizer and a tiny random GPT-2-shaped model."""

import pytest
import torch
from gptserve.model import GPT, ModelConfig, get_tokenizer


@pytest.fixture(scope="module")
def tok():
    return get_tokenizer()


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return GPT(ModelConfig(n_layer=2, n_head=4, n_embd=64, block_size=256)).eval()
