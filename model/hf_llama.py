"""Hugging Face Llama-family directories (Llama, Mistral, Qwen2, Qwen3, SmolLM) as GPT configs.

A family is a config entry plus a name map, not another model: `config_from_hf` reads the fields
of config.json into a `ModelConfig` (rotary, RMSNorm, SwiGLU, grouped-query attention, ...), and
`state_from_hf` renames the weights, joining q/k/v into one `c_attn` and gate/up into one `c_fc`.
Weights come from `model.safetensors` or from the shards that `model.safetensors.index.json` lists.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from model.config import ConfigError, ModelConfig

LLAMA_FAMILY = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
SUPPORTED = ("GPT2LMHeadModel", *LLAMA_FAMILY)
INDEX_FILE = "model.safetensors.index.json"


def architecture(raw: dict[str, Any]) -> str:
    """The one architecture a Hugging Face config.json names; refused unless supported."""
    names = raw.get("architectures") or []
    if not names and raw.get("model_type") == "gpt2":
        return "GPT2LMHeadModel"
    name = names[0] if len(names) == 1 else None
    if name not in SUPPORTED:
        shown = ", ".join(names) or f"model_type {raw.get('model_type')!r}"
        raise ConfigError(f"unsupported architecture {shown} (supported: {', '.join(SUPPORTED)})")
    return name


def _rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """rope_theta and the scaling: top-level keys (older files) or `rope_parameters`."""
    params = raw.get("rope_parameters") or {}
    theta = raw.get("rope_theta") or params.get("rope_theta") or 10000.0
    scaling = raw.get("rope_scaling") or params
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind in (None, "default"):
        return float(theta), None
    if kind != "llama3":
        raise ConfigError(f"rope_scaling of type {kind!r} is not supported (only 'llama3')")
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    return float(theta), {"rope_type": "llama3", **{k: scaling[k] for k in keys}}


def _windows(arch: str, raw: dict[str, Any]) -> tuple[int | None, list[str] | None]:
    """(sliding_window, layer_types) as transformers applies them: Mistral's `sliding_window`
    on every layer (or on those `layer_types` names); Qwen2's and Qwen3's only with
    `use_sliding_window`, on the layers from `max_window_layers` on unless `layer_types` says."""
    if arch == "MistralForCausalLM":
        window = raw.get("sliding_window")
    elif arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and raw.get("use_sliding_window"):
        window = raw.get("sliding_window")
        if window is not None and not raw.get("layer_types"):
            first = raw.get("max_window_layers", raw["num_hidden_layers"])
            kinds = ["sliding_attention" if i >= first else "full_attention"
                     for i in range(raw["num_hidden_layers"])]  # fmt: skip
            return window, kinds
    else:
        return None, None
    if window is None:
        return None, None
    return window, raw.get("layer_types") or None


def config_from_hf(raw: dict[str, Any]) -> ModelConfig:
    """A ModelConfig for a Llama-family config.json; one clear error for what is not supported."""
    arch = architecture(raw)
    window, layer_types = _windows(arch, raw)
    if raw.get("mlp_bias"):
        raise ConfigError("mlp_bias true is not supported")
    qwen2, qwen3 = arch == "Qwen2ForCausalLM", arch == "Qwen3ForCausalLM"
    if raw.get("attention_bias") and not qwen3:
        raise ConfigError("attention_bias true (biases on every projection) is not supported")
    theta, scaling = _rope(raw)
    hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
    head_dim = raw.get("head_dim") or hidden // heads
    return ModelConfig(
        vocab_size=raw["vocab_size"],
        block_size=raw.get("max_position_embeddings", 2048),
        n_layer=raw["num_hidden_layers"],
        n_head=heads,
        n_embd=hidden,
        n_kv_head=raw.get("num_key_value_heads") or heads,
        head_size=None if head_dim * heads == hidden else head_dim,
        intermediate_size=raw["intermediate_size"],
        bias=False,
        qkv_bias=qwen2 or bool(qwen3 and raw.get("attention_bias")),
        qk_norm=qwen3,
        tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        pos_encoding="rotary",
        norm="rmsnorm",
        activation="swiglu",
        layer_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        sliding_window=window,
        layer_types=layer_types,
        tokenizer="hf",
    )


def read_safetensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of `model.safetensors`, or of the shards its index names, in stored dtypes."""
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"{index} is not a safetensors index: {exc}") from None
        files = sorted(set(weight_map.values()))
    else:
        files = ["model.safetensors"]
    state: dict[str, torch.Tensor] = {}
    for name in files:
        path = directory / name
        if not path.is_file():
            raise ConfigError(f"{directory} has no {name}")
        try:
            state.update(load_file(str(path)))
        except (SafetensorError, OSError, ValueError) as exc:
            raise ConfigError(f"{path} is unreadable or truncated: {exc}") from None
    return state


def state_from_hf(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Hugging Face Llama-family tensor names -> ours (`transformer.h.N.attn.c_attn`, ...)."""
    out: dict[str, torch.Tensor] = {}

    def need(name: str) -> torch.Tensor:
        if name not in state:
            raise ConfigError(f"the checkpoint has no tensor {name}")
        return state[name]

    out["transformer.wte.weight"] = need("model.embed_tokens.weight")
    out["transformer.ln_f.weight"] = need("model.norm.weight")
    if not config.tie_embeddings:
        out["lm_head.weight"] = need("lm_head.weight")
    for i in range(config.n_layer):
        src, dst = f"model.layers.{i}.", f"transformer.h.{i}."
        qkv = [need(f"{src}self_attn.{p}_proj.weight") for p in "qkv"]
        out[dst + "attn.c_attn.weight"] = torch.cat(qkv)  # (nh + 2 n_kv) * hs rows, q first
        if config.attn_bias:
            out[dst + "attn.c_attn.bias"] = torch.cat(
                [need(f"{src}self_attn.{p}_proj.bias") for p in "qkv"]
            )
        out[dst + "attn.c_proj.weight"] = need(f"{src}self_attn.o_proj.weight")
        if config.qk_norm:
            out[dst + "attn.q_norm.weight"] = need(f"{src}self_attn.q_norm.weight")
            out[dst + "attn.k_norm.weight"] = need(f"{src}self_attn.k_norm.weight")
        gate_up = [need(f"{src}mlp.{p}_proj.weight") for p in ("gate", "up")]
        out[dst + "mlp.c_fc.weight"] = torch.cat(gate_up)  # gate rows, then up rows
        out[dst + "mlp.c_proj.weight"] = need(f"{src}mlp.down_proj.weight")
        out[dst + "ln_1.weight"] = need(f"{src}input_layernorm.weight")
        out[dst + "ln_2.weight"] = need(f"{src}post_attention_layernorm.weight")
    return out
