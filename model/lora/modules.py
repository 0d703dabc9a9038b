"""Where LoRA can go in our model, and what Hugging Face (and so PEFT) calls those places.

A target is one projection by its short name (q, k, v, o, gate, up, down); in our model it is a
slice of output rows of one linear layer (q, k and v of `attn.c_attn`, gate and up of `mlp.c_fc`).
Hugging Face's Llama family keeps each projection its own module (`self_attn.q_proj`, ...); its
GPT-2 keeps q|k|v fused in one Conv1D `attn.c_attn`, as we do, so a PEFT module there covers
several targets. Which naming applies follows the config: SwiGLU models are the Llama family.
"""

from __future__ import annotations

from dataclasses import dataclass

from gptserve.model.config import ModelConfig

TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


@dataclass(frozen=True)
class Slice:
    """Output rows [offset, offset + rows) of our layer `layer` (e.g. "transformer.h.0.attn.c_attn"),
    which reads `in_features` inputs."""

    layer: str
    offset: int
    rows: int
    in_features: int


def is_llama_family(config: ModelConfig) -> bool:
    """Hugging Face names a gated model's layers (SwiGLU: Llama, Qwen, Phi-3; GeGLU: Gemma 3) as
    Llama does; any other as GPT-2 does."""
    return config.gated_mlp


def _layer_slices(config: ModelConfig, i: int) -> dict[str, Slice]:
    """Each target of layer i that this architecture has, as a slice of one of our layers."""
    attn, mlp = f"transformer.h.{i}.attn.", f"transformer.h.{i}.mlp."
    q_rows, kv_rows = config.n_head * config.head_dim, config.kv_heads * config.head_dim
    width, n_embd = config.mlp_width, config.n_embd
    out = {
        "q": Slice(attn + "c_attn", 0, q_rows, n_embd),
        "k": Slice(attn + "c_attn", q_rows, kv_rows, n_embd),
        "v": Slice(attn + "c_attn", q_rows + kv_rows, kv_rows, n_embd),
        "o": Slice(attn + "c_proj", 0, n_embd, q_rows),
        "down": Slice(mlp + "c_proj", 0, n_embd, width),
    }
    if is_llama_family(config):
        out["gate"] = Slice(mlp + "c_fc", 0, width, n_embd)
        out["up"] = Slice(mlp + "c_fc", width, width, n_embd)
    else:  # GPT-2's MLP has one input projection: up, no gate
        out["up"] = Slice(mlp + "c_fc", 0, width, n_embd)
    return out


def available_targets(config: ModelConfig) -> tuple[str, ...]:
    """The targets this architecture has, in TARGETS' order."""
    return tuple(t for t in TARGETS if t in _layer_slices(config, 0))


def target_slices(config: ModelConfig, targets: tuple[str, ...]) -> dict[str, list[Slice]]:
    """Every layer's slices of `targets`, by our layer name, in row order; ValueError for a
    target this architecture lacks."""
    lacking = [t for t in targets if t not in available_targets(config)]
    if lacking:
        raise ValueError(
            f"this architecture has no {', '.join(lacking)} projection (it has "
            f"{', '.join(available_targets(config))})"
        )
    out: dict[str, list[Slice]] = {}
    for i in range(config.n_layer):
        slices = _layer_slices(config, i)
        for t in targets:
            out.setdefault(slices[t].layer, []).append(slices[t])
    for layer in out.values():
        layer.sort(key=lambda s: s.offset)
    return out


# PEFT (Hugging Face) module names, relative to the layer's block, with the targets they cover
_LLAMA_MODULES = {
    "self_attn.q_proj": ("q",),
    "self_attn.k_proj": ("k",),
    "self_attn.v_proj": ("v",),
    "self_attn.o_proj": ("o",),
    "mlp.gate_proj": ("gate",),
    "mlp.up_proj": ("up",),
    "mlp.down_proj": ("down",),
}
_GPT2_MODULES = {
    "attn.c_attn": ("q", "k", "v"),
    "attn.c_proj": ("o",),
    "mlp.c_fc": ("up",),
    "mlp.c_proj": ("down",),
}
# names that are no projection of a block: embeddings and the head, which we do not adapt
NOT_ADAPTABLE = ("lm_head", "embed_tokens", "wte", "wpe", "score")


def hf_block_prefix(config: ModelConfig, i: int) -> str:
    return f"model.layers.{i}." if is_llama_family(config) else f"transformer.h.{i}."


def hf_modules(config: ModelConfig) -> dict[str, tuple[str, ...]]:
    """PEFT's module names within a block ("self_attn.q_proj", or GPT-2's "attn.c_attn") and the
    targets each covers."""
    return _LLAMA_MODULES if is_llama_family(config) else _GPT2_MODULES


def hf_module_slice(config: ModelConfig, i: int, module: str) -> Slice:
    """The rows of our layer that Hugging Face's module `module` of block i is."""
    slices = _layer_slices(config, i)
    covered = [slices[t] for t in hf_modules(config)[module]]
    first, last = covered[0], covered[-1]
    return Slice(
        first.layer, first.offset, last.offset + last.rows - first.offset, first.in_features
    )


def adapter_slices(config: ModelConfig, targets: tuple[str, ...]) -> dict[str, list[Slice]]:
    """The slices a new adapter on `targets` trains, one low-rank pair each, by our layer name:
    one per PEFT module whose targets are all chosen (GPT-2's c_attn for q, k and v together, as
    PEFT trains it), else one per chosen target. ValueError for a target this model lacks."""
    target_slices(config, targets)  # refuses what this architecture lacks
    out: dict[str, list[Slice]] = {}
    for i in range(config.n_layer):
        layer = _layer_slices(config, i)
        for module, covered in hf_modules(config).items():
            chosen = [t for t in covered if t in targets]
            if not chosen:
                continue
            whole = len(chosen) == len(covered)
            for s in [hf_module_slice(config, i, module)] if whole else [layer[t] for t in chosen]:
                out.setdefault(s.layer, []).append(s)
    for slices in out.values():
        slices.sort(key=lambda s: s.offset)
    return out
