"""The network: its config, checkpoints, quantization and the tokenizer."""

from pathlib import Path

from model.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from model.config import ConfigError, ModelConfig
from model.gpt import GPT
from model.tokenizer import Tokenizer, get_tokenizer

# the bundled model that `python -m server` serves when no --model is given
DEFAULT_MODEL_DIR = Path(__file__).resolve().parent / "default_model"

__all__ = [
    "DEFAULT_MODEL_DIR",
    "GPT",
    "CheckpointError",
    "ConfigError",
    "ModelConfig",
    "Tokenizer",
    "get_tokenizer",
    "load_checkpoint",
    "save_checkpoint",
]
