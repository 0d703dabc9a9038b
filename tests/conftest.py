import os
import secrets
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

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


def pytest_sessionstart(session: pytest.Session) -> None:
    """Build (or load) the compiled CPU kernels once, before any test: servers that tests start
    in subprocesses then load the build from PyTorch's cache instead of compiling it against
    their start-up deadline."""
    from kernels.cpu.native import native_ops

    native_ops()


def save_tiny_gpt(path: Path, block_size: int = 256) -> Path:
    """A tiny random GPT-2-shaped checkpoint (2 layers, 4 heads, 64 wide) saved at `path`."""
    torch.manual_seed(0)
    save_checkpoint(GPT(ModelConfig(n_layer=2, n_head=4, n_embd=64, block_size=block_size)), path)
    return path


def byte_level_bpe(texts: Iterable[str], vocab_size: int, specials: list[str]) -> Tokenizer:
    """A byte-level BPE (GPT-2's pre-tokenizer and decoder) learned from `texts`, its special
    tokens first."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tok.train_from_iterator(texts, trainer)
    return tok


SHAKESPEARE = REPO / "data" / "shakespeare.txt"


@pytest.fixture(scope="session")
def shakespeare_path() -> Path:
    if not SHAKESPEARE.is_file():
        pytest.fail(f"training corpus not found at {SHAKESPEARE}")
    return SHAKESPEARE


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random GPT-2-shaped checkpoint directory named "tiny-gpt" (the served model's id)."""
    return save_tiny_gpt(tmp_path_factory.mktemp("ckpt") / "tiny-gpt")
