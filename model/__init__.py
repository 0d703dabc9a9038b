"""The network: its config, checkpoints, quantization and the tokenizers.

`Tokenizer` is the protocol every tokenizer meets; `get_tokenizer("gpt2")` is GPT-2's
(`model.tokenizers.GPT2Tokenizer`).
"""

from pathlib import Path

from gptserve.model.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from gptserve.model.config import ConfigError, ModelConfig
from gptserve.model.gpt import GPT
from gptserve.model.tokenizers import Tokenizer, get_tokenizer

# the bundled model `train.py` made (`--model shakespeare`); the default one is fetched by name
# (model.known_models), and this one serves when that cannot be fetched
SHAKESPEARE_DIR = Path(__file__).resolve().parent / "shakespeare"

__all__ = [
    "SHAKESPEARE_DIR",
    "GPT",
    "CheckpointError",
    "ConfigError",
    "ModelConfig",
    "Tokenizer",
    "get_tokenizer",
    "load_checkpoint",
    "save_checkpoint",
]
