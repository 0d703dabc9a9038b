"""Hugging Face Llama-family directories (Llama, Mistral, Qwen2, Qwen3, SmolLM, Phi-3) as GPT
configs.

A family is a config entry plus a name map, not another model: `config_from_hf` reads the fields
of config.json into a `ModelConfig` (rotary, RMSNorm, SwiGLU, grouped-query attention, ...), and
`state_from_hf` renames the weights, joining q/k/v into one `c_attn` and gate/up into one `c_fc`
(Phi-3 stores them joined already, in that order: `qkv_proj`, `gate_up_proj`; Phi-4-mini is a
Phi-3 that rotates only part of each head, `ModelConfig.rotary_dim`). Weights come from
`model.safetensors` or from the shards that `model.safetensors.index.json` lists. Gemma 3 is
`model.hf_gemma`; `architecture` names every architecture a directory may have.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from gptserve.model.config import ConfigError, ModelConfig
from safetensors import SafetensorError
from safetensors.torch import load_file

LLAMA_FAMILY = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",
)
GEMMA = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")  # model.hf_gemma
SUPPORTED = ("GPT2LMHeadModel", *LLAMA_FAMILY, *GEMMA)
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
    if kind in ("longrope", "su"):
        return float(theta), _longrope(raw, scaling)
    if kind != "llama3":
        raise ConfigError(
            f"rope_scaling of type {kind!r} is not supported (llama3; Phi-3's longrope)"
        )
    keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    return float(theta), {"rope_type": "llama3", **{k: scaling[k] for k in keys}}


def _longrope(raw: dict[str, Any], scaling: dict[str, Any]) -> dict[str, Any]:
    """Phi-3's long-context rotation within its original context: the short factors and the
    attention factor transformers applies there (longer sequences would need the long factors,
    so the context is capped at original_max_position_embeddings: `context_length`)."""
    original = scaling.get("original_max_position_embeddings") or raw.get(
        "original_max_position_embeddings"
    )
    if not original or "short_factor" not in scaling:
        raise ConfigError(
            "longrope rope_scaling needs short_factor and original_max_position_embeddings"
        )
    factor = scaling.get("factor") or raw["max_position_embeddings"] / original
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return {
        "rope_type": "longrope",
        "short_factor": [float(f) for f in scaling["short_factor"]],
        "attention_factor": float(attention),
        "original_max_position_embeddings": int(original),
    }


def context_length(raw: dict[str, Any], scaling: dict[str, Any] | None) -> int:
    """The most tokens served: max_position_embeddings, or a longrope model's original context."""
    if scaling is not None and scaling["rope_type"] == "longrope":
        return scaling["original_max_position_embeddings"]
    return raw.get("max_position_embeddings", 2048)


def _windows(arch: str, raw: dict[str, Any]) -> tuple[int | None, list[str] | None]:
    """(sliding_window, layer_types) as transformers applies them: Mistral's and Phi-3's
    `sliding_window` on every layer (or on those `layer_types` names); Qwen2's and Qwen3's only with
    `use_sliding_window`, on the layers from `max_window_layers` on unless `layer_types` says."""
    if arch in ("MistralForCausalLM", "Phi3ForCausalLM"):  # Phi-3 mini's: every layer
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
    rotary_dim = _check_phi3(raw, head_dim) if arch == "Phi3ForCausalLM" else None
    return ModelConfig(
        vocab_size=raw["vocab_size"],
        block_size=context_length(raw, scaling),
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
        rotary_dim=rotary_dim,
        sliding_window=window,
        layer_types=layer_types,
        tokenizer="hf",
    )


def _check_phi3(raw: dict[str, Any], head_dim: int) -> int | None:
    """Phi-3's own fields (its longrope scaling is `_rope`'s): the rotary dim of a partial
    rotation (Phi-4-mini's partial_rotary_factor 0.75), int(factor * head_dim) leading channels
    of each head as transformers takes them; None: the whole head."""
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"Phi-3 hidden_act {act!r} is not supported (only silu)")
    params = raw.get("rope_parameters") or {}
    partial = raw.get("partial_rotary_factor", params.get("partial_rotary_factor"))
    if partial is None or partial == 1:
        return None
    if isinstance(partial, bool) or not isinstance(partial, (int, float)) or not 0 < partial < 1:
        raise ConfigError(f"partial_rotary_factor must be a number in (0, 1], got {partial!r}")
    rotary_dim = int(head_dim * partial)
    if rotary_dim < 2 or rotary_dim % 2:
        raise ConfigError(
            f"partial_rotary_factor {partial} of head_dim {head_dim} rotates {rotary_dim} "
            "channels; an even number of at least 2 is needed"
        )
    return rotary_dim


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


def required(state: dict[str, torch.Tensor]) -> Callable[[str], torch.Tensor]:
    """`state`'s tensors by name; a missing one is refused in one line."""

    def need(name: str) -> torch.Tensor:
        if name not in state:
            raise ConfigError(f"the checkpoint has no tensor {name}")
        return state[name]

    return need


def embedding_and_head(
    need: Callable[[str], torch.Tensor], config: ModelConfig
) -> dict[str, torch.Tensor]:
    """Our token table, final norm and (untied) head from a Hugging Face decoder's names."""
    out = {
        "transformer.wte.weight": need("model.embed_tokens.weight"),
        "transformer.ln_f.weight": need("model.norm.weight"),
    }
    if not config.tie_embeddings:
        out["lm_head.weight"] = need("lm_head.weight")
    return out


def state_from_hf(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Hugging Face Llama-family tensor names -> ours (`transformer.h.N.attn.c_attn`, ...)."""
    need = required(state)
    out = embedding_and_head(need, config)
    fused = "model.layers.0.self_attn.qkv_proj.weight" in state  # Phi-3
    for i in range(config.n_layer):
        src, dst = f"model.layers.{i}.", f"transformer.h.{i}."
        if fused:  # q, k, v rows and gate, up rows already joined in our order
            out[dst + "attn.c_attn.weight"] = need(f"{src}self_attn.qkv_proj.weight")
            out[dst + "attn.c_proj.weight"] = need(f"{src}self_attn.o_proj.weight")
            out[dst + "mlp.c_fc.weight"] = need(f"{src}mlp.gate_up_proj.weight")
            out[dst + "mlp.c_proj.weight"] = need(f"{src}mlp.down_proj.weight")
            out[dst + "ln_1.weight"] = need(f"{src}input_layernorm.weight")
            out[dst + "ln_2.weight"] = need(f"{src}post_attention_layernorm.weight")
            continue
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
