"""GGUF files (llama.cpp's format) as GPT configs and weights, read with the `gguf` package.

Architectures `llama` (also SmolLM and Mistral files), `qwen2`, `qwen3`, `gemma3` and `gpt2`; tensors F32,
F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K and Q6_K. `read_gguf` returns the config, the tokenizer and
chat template from the metadata, and the tensors by our names (`quantized_tensors` keeps them at
their own bits; `dequantized_state` turns them into float).

llama.cpp's converter reorders the rows of Q and K of `llama` models so that each head's two
rotary halves are interleaved (its rotation pairs neighbours); `unpermute_rows` puts them back
in Hugging Face's half-split order, which our rotary embedding uses. `qwen2`, `qwen3` and `gemma3`
files are stored unpermuted (llama.cpp rotates them in the split layout).

`gemma3` files store each norm's weight as Gemma computes with it, 1 + w (llama.cpp's converter
adds the one); `read_gguf` gives back w, which `GemmaRMSNorm` holds. What the file does not say
is llama.cpp's for the architecture: every sixth layer global and the others sliding
(`attention.sliding_window`), the sliding layers' rotary base 10000, attention scaled by
1 / sqrt(head_dim) (by 1 / sqrt(n_embd / n_head) for the 62-layer 27B), no logit soft-cap.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gptserve.model.config import ConfigError, ModelConfig

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "gemma3", "gpt2")
GEMMA3_PATTERN = 6  # llama.cpp's: layer i is global when (i + 1) % 6 == 0
GEMMA3_LOCAL_THETA = 10_000.0
GEMMA3_27B_LAYERS = 62  # the one size whose attention scale is not head_dim's
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
    rope_dims = meta.get(f"{arch}.rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim:  # a partial rotation
        raise ConfigError(
            f"{path.name}: {arch}.rope.dimension_count {int(rope_dims)} rotates part of each "
            f"{head_dim}-channel head, which is not supported in GGUF files (only the whole head)"
        )
    if arch == "gemma3":
        return _gemma3_config(meta, common, head_dim, field)
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


def _gemma3_config(
    meta: dict[str, Any], common: dict[str, Any], head_dim: int, field
) -> ModelConfig:  # noqa: ANN001
    """A gemma3 file's config: its keys, and llama.cpp's fixed choices (module docstring)."""
    n_layer, n_embd, n_head = common["n_layer"], common["n_embd"], common["n_head"]
    kinds = [
        "full_attention" if (i + 1) % GEMMA3_PATTERN == 0 else "sliding_attention"
        for i in range(n_layer)
    ]
    scaling = None
    kind = meta.get("gemma3.rope.scaling.type")
    if kind == "linear":
        scaling = {"rope_type": "linear", "factor": float(field("rope.scaling.factor"))}
    elif kind not in (None, "none"):
        raise ConfigError(f"gemma3 rope scaling {kind!r} is not supported (only linear)")
    scalar = n_embd // n_head if n_layer == GEMMA3_27B_LAYERS else head_dim
    return ModelConfig(
        **common,
        n_kv_head=int(field("attention.head_count_kv", n_head)),
        head_size=None if head_dim * n_head == n_embd else head_dim,
        bias=False,
        qk_norm=True,
        pos_encoding="rotary",
        norm="gemma_rmsnorm",
        sandwich_norm=True,
        activation="geglu",
        layer_norm_eps=float(field("attention.layer_norm_rms_epsilon")),
        rope_theta=float(meta.get("gemma3.rope.freq_base", 1_000_000.0)),
        rope_scaling=scaling,
        rope_local_theta=GEMMA3_LOCAL_THETA,
        sliding_window=int(field("attention.sliding_window")),
        layer_types=kinds,
        embed_scale=n_embd**0.5,
        query_pre_attn_scalar=scalar,
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
_GEMMA3_NAMES = {
    **_LLAMA_NAMES,
    "post_attention_norm": ("post_attn_norm", None),
    "post_ffw_norm": ("post_mlp_norm", None),
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
    block_names = {"gpt2": _GPT2_NAMES, "gemma3": _GEMMA3_NAMES}.get(arch, _LLAMA_NAMES)
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
        if arch == "gemma3" and t.name.endswith("norm.weight"):
            raw = _minus_one(raw)  # the file's 1 + w
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


def _minus_one(raw: RawTensor) -> RawTensor:
    """A Gemma norm's stored 1 + w as w, float32."""
    return RawTensor(_to_float(raw) - np.float32(1.0), "F32", raw.shape)


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
