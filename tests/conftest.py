import os
import secrets
from pathlib import Path

import pytest
import torch

from model import GPT, ModelConfig, save_checkpoint

# Ray's token authentication with a token of this run's, written nowhere. Ray reads these once,
# when it is first imported, and more than one test module imports it: set them before any does.
for _key, _value in {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "token",
    "RAY_AUTH_TOKEN": secrets.token_hex(32),
}.items():
    os.environ.setdefault(_key, _value)

REPO = Path(__file__).resolve().parents[1]
SHAKESPEARE = REPO / "data" / "shakespeare.txt"


@pytest.fixture(scope="session")
def shakespeare_path() -> Path:
    if not SHAKESPEARE.is_file():
        pytest.fail(f"training corpus not found at {SHAKESPEARE}")
    return SHAKESPEARE


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random GPT-2-shaped checkpoint directory named "tiny-gpt" (the served model's id)."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("ckpt") / "tiny-gpt"
    save_checkpoint(GPT(ModelConfig(n_layer=2, n_head=4, n_embd=64, block_size=256)), path)
    return path
