import os
import secrets
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch
from gptserve.model import GPT, ModelConfig, save_checkpoint
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

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
    from gptserve.kernels.cpu.native import native_ops

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


class PagedCache:
    """A KV cache as the engine pairs its two halves, for tests that drive a model's cached
    forward themselves: the block bookkeeping (`blocks`, the scheduler's) and the pools with
    their attention (`pools`, the runner's). `prepare` reserves a step's blocks, makes the block
    copies it needs and returns its metadata, as the engine's step does. `model` is a GPT, or
    (n_layer, n_kv_head, head_dim) for pools of that shape."""

    def __init__(
        self, model: torch.nn.Module | tuple[int, int, int], num_blocks: int,
        block_size: int = 16, block_order: list[int] | None = None, prefix_caching: bool = True,
        **pool_args: object,
    ) -> None:  # fmt: skip
        from gptserve.engine.block_manager import BlockManager
        from gptserve.kernels.paged_kv import KVPools

        if isinstance(model, tuple):
            self.pools = KVPools(*model, num_blocks, block_size, **pool_args)
        else:
            self.pools = KVPools.for_model(model, num_blocks, block_size, **pool_args)
        self.blocks = BlockManager(
            num_blocks, block_size, self.pools.device, block_order, prefix_caching
        )

    def prepare(self, batch: list[tuple[int, int]]):  # noqa: ANN201
        step = self.blocks.prepare(batch)
        self.pools.copy_blocks(step.copies)
        return step.meta

    def copy_pending(self) -> None:
        """Make the block copies asked for since the last step now (a prefix match's)."""
        self.pools.copy_blocks(self.blocks.take_copies())
