"""The network and everything that turns logits into tokens."""

from model.cache import BlockAllocator, KVCache, OutOfBlocks
from model.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from model.config import ConfigError, ModelConfig
from model.gpt import GPT
from model.tokenizer import Tokenizer, get_tokenizer

__all__ = [
    "GPT",
    "BlockAllocator",
    "CheckpointError",
    "ConfigError",
    "KVCache",
    "ModelConfig",
    "OutOfBlocks",
    "Tokenizer",
    "get_tokenizer",
    "load_checkpoint",
    "save_checkpoint",
]
