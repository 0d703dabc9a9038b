"""GGUF files (llama.cpp's format) as GPT configs and weights, read with the `gguf` package.

Architectures `llama` (also SmolLM and Mistral files), `qwen2`, `qwen3` and `gpt2`; tensors F32,
F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K and Q6_K. `read_gguf` returns the config, the tokenizer and
chat template from the metadata, and the tensors by our names (`quantized_tensors` keeps them at
their own bits; `dequantized_state` turns them into float).

llama.cpp's converter reorders the rows of Q and K of `llama` models so that each head's two
rotary halves are interleaved (its rotation pairs neighbours); `unpermute_rows` puts them back
in Hugging Face's half-split order, which our rotary embedding uses. `qwen2` and `qwen3` files are
stored unpermuted (llama.cpp rotates them in the split layout).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from model.config import ConfigError, ModelConfig

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "gpt2")
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")


@dataclass
class RawTensor:
    """One tensor as the file stores it: numpy data (bytes for quantized types), its GGML type
    name, its shape in torch order (rows, columns) and where its bytes start in the file (None once
    its rows are reordered)."""

    data: np.ndarray
    type: str
    shape: tuple[int, ...]
    offset: int | None = None


@dataclass
class GGUFModel:
    config: ModelConfig
    metadata: dict[str, Any]
    tensors: dict[str, RawTensor]  # by our parameter names, Q and K rows already in HF order
    rope_freq_factors: torch.Tensor | None = None  # Llama 3 files: divisors of inv_freq


def _reader(path: Path):  # noqa: ANN202 - gguf's reader class
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path} is not a readable GGUF file: {exc}") from None


def read_metadata(path: Path) -> dict[str, Any]:
    reader = _reader(path)
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order: per head (2 halves interleaved) -> (first half, second)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _config(meta: dict[str, Any], names: set[str], path: Path) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ConfigError(
            f"{path.name}: GGUF architecture {arch!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ARCHS)})"
        )

    def field(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ConfigError(f"{path.name}: GGUF metadata has no {arch}.{key}")
        return value

    vocab = len(meta.get("tokenizer.ggml.tokens") or []) or field("vocab_size")
    n_embd, n_head = int(field("embedding_length")), int(field("attention.head_count"))
    common = dict(
        vocab_size=int(vocab),
        block_size=int(field("context_length")),
        n_layer=int(field("block_count")),
        n_head=n_head,
        n_embd=n_embd,
        intermediate_size=int(field("feed_forward_length")),
        tie_embeddings="output.weight" not in names,
        tokenizer="gguf",
    )
    if arch == "gpt2":
        if common["intermediate_size"] != 4 * n_embd:
            raise ConfigError(f"{path.name}: gpt2 with feed_forward_length != 4 * n_embd")
        return ModelConfig(**common, layer_norm_eps=float(field("attention.layer_norm_epsilon")))
    head_dim = int(meta.get(f"{arch}.attention.key_length") or n_embd // n_head)
    # a `llama` file of a Mistral with its window keeps it in attention.sliding_window: every layer
    window = meta.get(f"{arch}.attention.sliding_window") if arch == "llama" else None
    return ModelConfig(
        **common,
        n_kv_head=int(field("attention.head_count_kv", n_head)),
        head_size=None if head_dim * n_head == n_embd else head_dim,
        bias=False,
        qkv_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        pos_encoding="rotary",
        norm="rmsnorm",
        activation="swiglu",
        layer_norm_eps=float(field("attention.layer_norm_rms_epsilon")),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        sliding_window=None if window is None else int(window),
    )


_LLAMA_NAMES = {  # GGUF block tensor -> (our module, part of a joined matrix or None)
    "attn_norm": ("ln_1", None),
    "ffn_norm": ("ln_2", None),
    "attn_output": ("attn.c_proj", None),
    "attn_q_norm": ("attn.q_norm", None),
    "attn_k_norm": ("attn.k_norm", None),
    "ffn_down": ("mlp.c_proj", None),
    "attn_q": ("attn.c_attn", 0),
    "attn_k": ("attn.c_attn", 1),
    "attn_v": ("attn.c_attn", 2),
    "ffn_gate": ("mlp.c_fc", 0),
    "ffn_up": ("mlp.c_fc", 1),
}
_GPT2_NAMES = {
    "attn_norm": ("ln_1", None),
    "ffn_norm": ("ln_2", None),
    "attn_qkv": ("attn.c_attn", None),
    "attn_output": ("attn.c_proj", None),
    "ffn_up": ("mlp.c_fc", None),
    "ffn_down": ("mlp.c_proj", None),
}
_TOP_NAMES = {
    "token_embd": "transformer.wte",
    "position_embd": "transformer.wpe",
    "output_norm": "transformer.ln_f",
    "output": "lm_head",
}


def read_gguf(path: str | Path) -> GGUFModel:
    """The config and the raw tensors of a GGUF file, by our names (joined parts kept apart:
    `parts` lists q/k/v and gate/up in order under `name#0`, `name#1`, ...)."""
    path = Path(path)
    reader = _reader(path)
    meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    names = {t.name for t in reader.tensors}
    config = _config(meta, names, path)
    arch = meta["general.architecture"]
    block_names = _GPT2_NAMES if arch == "gpt2" else _LLAMA_NAMES
    tensors: dict[str, RawTensor] = {}
    factors = None
    for t in reader.tensors:
        kind = t.tensor_type.name
        if kind not in SUPPORTED_TYPES:
            raise ConfigError(
                f"{path.name}: tensor {t.name} has GGML type {kind}, not supported "
                f"(supported: {', '.join(SUPPORTED_TYPES)})"
            )
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGML lists columns first
        raw = RawTensor(np.asarray(t.data), kind, shape, int(t.data_offset))
        stem, _, suffix = t.name.rpartition(".")  # "blk.3.attn_q", "weight"
        if t.name == "rope_freqs.weight":
            factors = torch.from_numpy(_to_float(raw).copy())
            continue
        if stem.startswith("blk."):
            _, layer, part = stem.split(".", 2)
            if part not in block_names:
                raise ConfigError(f"{path.name}: unexpected tensor {t.name}")
            module, index = block_names[part]
            if arch == "llama" and part in ("attn_q", "attn_k") and suffix == "weight":
                heads = config.n_head if part == "attn_q" else config.kv_heads
                raw = _unpermuted(raw, heads)
            key = f"transformer.h.{layer}.{module}.{suffix}"
            tensors[key if index is None else f"{key}#{index}"] = raw
        elif stem in _TOP_NAMES:
            tensors[f"{_TOP_NAMES[stem]}.{suffix}"] = raw
        else:
            raise ConfigError(f"{path.name}: unexpected tensor {t.name}")
    return GGUFModel(config, meta, tensors, factors)


def _unpermuted(raw: RawTensor, n_head: int) -> RawTensor:
    """Q/K rows back in HF order; rows are whole quantized blocks, so raw bytes move as rows."""
    return RawTensor(unpermute_rows(raw.data, n_head), raw.type, raw.shape)


def _to_float(raw: RawTensor) -> np.ndarray:
    """float32 numpy array of the tensor's shape."""
    import gguf

    if raw.type == "F32":
        return raw.data.astype(np.float32, copy=False).reshape(raw.shape)
    if raw.type == "F16":
        return raw.data.astype(np.float32).reshape(raw.shape)
    qtype = gguf.GGMLQuantizationType[raw.type]
    return gguf.quants.dequantize(raw.data, qtype).astype(np.float32).reshape(raw.shape)


def dequantized_state(model: GGUFModel) -> dict[str, torch.Tensor]:
    """Every tensor as float32, joined parts (q/k/v, gate/up) concatenated by rows."""
    state: dict[str, torch.Tensor] = {}
    parts: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for name, raw in model.tensors.items():
        tensor = torch.from_numpy(_to_float(raw).copy())
        if "#" in name:
            base, index = name.split("#")
            parts.setdefault(base, []).append((int(index), tensor))
        else:
            state[name] = tensor
    for base, pieces in parts.items():
        state[base] = torch.cat([t for _, t in sorted(pieces, key=lambda p: p[0])])
    return state
