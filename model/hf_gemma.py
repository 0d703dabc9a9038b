"""Hugging Face Gemma 3 directories (text only) as GPT configs: a config entry and a name map.

Gemma 3 is the Llama family's fields plus a few of its own (`model.config.ModelConfig`): the
(1 + weight) RMSNorm around both branches of every layer (input_layernorm -> ln_1,
post_attention_layernorm -> post_attn_norm, pre_feedforward_layernorm -> ln_2,
post_feedforward_layernorm -> post_mlp_norm), q/k norms, a GeGLU MLP, the embedding times
sqrt(hidden_size), sliding-window layers rotating by rope_local_base_freq and global ones by
rope_theta (and its rope_scaling), query_pre_attn_scalar and final_logit_softcapping.

`Gemma3ForCausalLM` (model_type gemma3_text) and the text part of a
`Gemma3ForConditionalGeneration` directory (its `text_config`; the vision tower's weights are
left unread). Fields a config.json leaves out take transformers' Gemma3TextConfig defaults.
"""

from __future__ import annotations

from typing import Any

import torch
from gptserve.model.config import ConfigError, ModelConfig
from gptserve.model.hf_llama import architecture, embedding_and_head, required

MULTIMODAL = "Gemma3ForConditionalGeneration"
# transformers' Gemma3TextConfig defaults, for the fields a config.json may leave out
DEFAULTS: dict[str, Any] = dict(
    vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
    num_attention_heads=8, num_key_value_heads=4, head_dim=256, max_position_embeddings=131_072,
    rms_norm_eps=1e-6, query_pre_attn_scalar=256, sliding_window=4096,
    rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, hidden_activation="gelu_pytorch_tanh",
    tie_word_embeddings=True,
)  # fmt: skip
GELU_TANH = ("gelu_pytorch_tanh", "gelu_new")
_NULLABLE = ("final_logit_softcapping", "attn_logit_softcapping", "rope_scaling", "layer_types")
_TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "model.")  # -> "model."
_SKIPPED_PREFIXES = ("vision_tower.", "model.vision_tower.", "multi_modal_projector.",
                     "model.multi_modal_projector.")  # fmt: skip


def text_config(raw: dict[str, Any], arch: str) -> dict[str, Any]:
    """The text model's config.json fields (a multimodal config's `text_config`), defaults
    filled in."""
    if arch == MULTIMODAL:
        raw = raw.get("text_config") or {}
        if not isinstance(raw, dict):
            raise ConfigError("Gemma3ForConditionalGeneration's text_config is not an object")
    return {**DEFAULTS, **{k: v for k, v in raw.items() if v is not None or k in _NULLABLE}}


def _layer_types(raw: dict[str, Any]) -> list[str]:
    """`layer_types`, or sliding_window_pattern's: every pattern-th layer global."""
    if raw.get("layer_types"):
        return list(raw["layer_types"])
    pattern = raw.get("sliding_window_pattern") or raw.get("_sliding_window_pattern") or 6
    return [
        "sliding_attention" if (i + 1) % int(pattern) else "full_attention"
        for i in range(raw["num_hidden_layers"])
    ]


def _rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None, float]:
    """The global layers' theta and scaling, the sliding layers' theta: from transformers 5's
    per-layer-type `rope_parameters` or the older rope_theta, rope_scaling and
    rope_local_base_freq."""
    params = raw.get("rope_parameters") or {}
    full = dict(params.get("full_attention") or {})
    local = dict(params.get("sliding_attention") or {})
    if not full:  # the older keys
        full = dict(raw.get("rope_scaling") or {})
        full["rope_theta"] = raw["rope_theta"]
    local.setdefault("rope_theta", raw["rope_local_base_freq"])
    if local.get("rope_type", local.get("type", "default")) != "default":
        raise ConfigError("Gemma 3 with a scaled rope on its sliding layers is not supported")
    kind = full.get("rope_type", full.get("type", "default"))
    if kind == "default":
        scaling = None
    elif kind == "linear":
        scaling = {"rope_type": "linear", "factor": float(full["factor"])}
    else:
        raise ConfigError(f"Gemma 3 rope_scaling of type {kind!r} is not supported (only linear)")
    theta = full.get("rope_theta", raw["rope_theta"])
    return float(theta), scaling, float(local["rope_theta"])


def config_from_hf(raw: dict[str, Any]) -> ModelConfig:
    """A ModelConfig for a Gemma 3 config.json; one clear error for what is not supported."""
    raw = text_config(raw, architecture(raw))
    if raw.get("attn_logit_softcapping") is not None:
        raise ConfigError("Gemma 3 with attn_logit_softcapping set is not supported")
    if raw.get("use_bidirectional_attention"):
        raise ConfigError("use_bidirectional_attention true is not supported")
    if raw.get("attention_bias"):
        raise ConfigError("attention_bias true (biases on every projection) is not supported")
    if raw["hidden_activation"] not in GELU_TANH:
        raise ConfigError(
            f"Gemma 3 hidden_activation {raw['hidden_activation']!r} is not supported "
            f"(only {', '.join(GELU_TANH)})"
        )
    theta, scaling, local_theta = _rope(raw)
    hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
    head_dim = raw["head_dim"] or hidden // heads
    return ModelConfig(
        vocab_size=raw["vocab_size"],
        block_size=raw["max_position_embeddings"],
        n_layer=raw["num_hidden_layers"],
        n_head=heads,
        n_embd=hidden,
        n_kv_head=raw["num_key_value_heads"] or heads,
        head_size=None if head_dim * heads == hidden else head_dim,
        intermediate_size=raw["intermediate_size"],
        bias=False,
        qk_norm=True,
        tie_embeddings=bool(raw["tie_word_embeddings"]),
        pos_encoding="rotary",
        norm="gemma_rmsnorm",
        sandwich_norm=True,
        activation="geglu",
        layer_norm_eps=raw["rms_norm_eps"],
        rope_theta=theta,
        rope_scaling=scaling,
        rope_local_theta=local_theta,
        sliding_window=raw["sliding_window"],
        layer_types=_layer_types(raw),
        embed_scale=hidden**0.5,
        query_pre_attn_scalar=raw["query_pre_attn_scalar"],
        logit_softcap=raw.get("final_logit_softcapping"),
        tokenizer="hf",
    )


def _text_weights(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The language model's tensors under "model." (and "lm_head."), the vision tower's
    dropped: a multimodal checkpoint names them "model.language_model." or
    "language_model.model."."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name.startswith(_SKIPPED_PREFIXES):
            continue
        if name.startswith("language_model.lm_head."):
            name = name.removeprefix("language_model.")
        for prefix in _TEXT_PREFIXES:
            if name.startswith(prefix):
                name = "model." + name.removeprefix(prefix)
                break
        out[name] = tensor
    return out


def state_from_hf(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Gemma 3 tensor names -> ours, q/k/v joined into `c_attn` and gate/up into `c_fc`."""
    state = _text_weights(state)
    need = required(state)
    out = embedding_and_head(need, config)
    norms = {
        "ln_1": "input_layernorm",
        "post_attn_norm": "post_attention_layernorm",
        "ln_2": "pre_feedforward_layernorm",
        "post_mlp_norm": "post_feedforward_layernorm",
        "attn.q_norm": "self_attn.q_norm",
        "attn.k_norm": "self_attn.k_norm",
    }
    for i in range(config.n_layer):
        src, dst = f"model.layers.{i}.", f"transformer.h.{i}."
        qkv = [need(f"{src}self_attn.{p}_proj.weight") for p in "qkv"]
        out[dst + "attn.c_attn.weight"] = torch.cat(qkv)  # (nh + 2 n_kv) * hs rows, q first
        out[dst + "attn.c_proj.weight"] = need(f"{src}self_attn.o_proj.weight")
        gate_up = [need(f"{src}mlp.{p}_proj.weight") for p in ("gate", "up")]
        out[dst + "mlp.c_fc.weight"] = torch.cat(gate_up)  # gate rows, then up rows
        out[dst + "mlp.c_proj.weight"] = need(f"{src}mlp.down_proj.weight")
        for ours, theirs in norms.items():
            out[f"{dst}{ours}.weight"] = need(f"{src}{theirs}.weight")
    return out
