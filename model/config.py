"""Model hyper-parameters: a dataclass with a JSON round trip and one-line validation errors."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

POS_ENCODINGS = ("learned", "sinusoidal", "rotary")
NORM_POSITIONS = ("pre", "post")
NORMS = ("layernorm", "rmsnorm", "gemma_rmsnorm")
ACTIVATIONS = ("gelu", "relu", "swiglu", "geglu")
ROPE_SCALINGS = ("default", "llama3", "linear", "longrope")
LAYER_TYPES = ("full_attention", "sliding_attention")


class ConfigError(ValueError):
    """An inconsistent or unreadable model configuration."""


@dataclass
class ModelConfig:
    """GPT-2 by default; the original Transformer's choices are options.

    pos_encoding: "learned" (GPT-2 `wpe`) or "sinusoidal" (fixed, no parameters).
    norm_position: "pre" (GPT-2: x + f(LN(x)), final LN) or "post" ("Add & Norm": LN(x + f(x))).
    activation: "gelu" (tanh approximation, as GPT-2) or "relu"; "swiglu" is Llama's gated MLP,
        down(silu(gate(x)) * up(x)), with gate and up stored as one `c_fc` of 2 * mlp_width rows;
        "geglu" is Gemma's, the same with gelu (tanh approximation) for silu.

    The Llama family (Llama, Mistral, Qwen2, Qwen3, SmolLM, Phi-3) is these fields, not another
    model: pos_encoding "rotary" (rope_theta, and rope_scaling {"rope_type": "llama3", ...}, or
    Phi-3's {"rope_type": "longrope", "short_factor", "attention_factor"}; rotary_dim when only a
    head's leading channels rotate, Phi-4-mini's), norm
    "rmsnorm", activation "swiglu", n_kv_head < n_head for grouped-query attention, head_size
    when heads are not n_embd // n_head wide, qkv_bias (Qwen2) and qk_norm (Qwen3: RMSNorm of
    each query and key head before the rotation), bias False, tie_embeddings as the checkpoint.
    q, k and v are one `c_attn` of (n_head + 2 * n_kv_head) * head_dim rows, q first.

    Gemma 3 adds: norm "gemma_rmsnorm" (x / rms(x) * (1 + weight), in float32), sandwich_norm (a
    norm on each branch's output too), embed_scale (sqrt(n_embd) times the embedding), activation
    "geglu", rope_local_theta (the rotary base of sliding-window layers), query_pre_attn_scalar
    (attention scores scaled by its inverse square root) and logit_softcap.
    """

    vocab_size: int = 50257
    block_size: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True
    tie_embeddings: bool = True
    pos_encoding: str = "learned"
    norm_position: str = "pre"
    activation: str = "gelu"
    layer_norm_eps: float = 1e-5
    tokenizer: str = "gpt2"  # "gpt2" (tiktoken) or "hf": the checkpoint's own tokenizer.json
    norm: str = "layernorm"
    n_kv_head: int | None = None  # None: n_head (no grouping)
    head_size: int | None = None  # None: n_embd // n_head
    intermediate_size: int | None = None  # the MLP's width; None: 4 * n_embd
    qkv_bias: bool | None = None  # None: as `bias`
    qk_norm: bool = False
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    # how many leading channels of each query and key head rotate (Phi-4-mini's
    # partial_rotary_factor of head_dim, as transformers takes it): the rotation's frequencies are
    # over these, and the channels after them pass through unrotated; None: all head_dim
    rotary_dim: int | None = None
    # sliding-window attention (Mistral, Gemma 3, Phi-3): a windowed layer's query at position i
    # sees keys at positions j with i - sliding_window < j <= i (itself included), as Hugging
    # Face's `sliding_window`; None: every layer attends to the whole context
    sliding_window: int | None = None
    # each layer's kind, Hugging Face's `layer_types`: "sliding_attention" (windowed) or
    # "full_attention"; None: every layer windowed when sliding_window is set
    layer_types: list[str] | None = None
    # Gemma 3: a norm on the attention's and the MLP's outputs before each residual add (each
    # layer's post_attn_norm and post_mlp_norm), as well as on their inputs (ln_1, ln_2)
    sandwich_norm: bool = False
    embed_scale: float | None = None  # the embedding times this, in the model's dtype; None: 1
    # the rotary base of "sliding_attention" layers (Gemma 3's rope_local_base_freq; never
    # scaled); None: rope_theta for every layer
    rope_local_theta: float | None = None
    # attention scores are q.k / sqrt(query_pre_attn_scalar); None: head_dim (the usual scale)
    query_pre_attn_scalar: float | None = None
    logit_softcap: float | None = None  # logits become cap * tanh(logits / cap); None: as they are

    def __post_init__(self) -> None:
        self.validate()

    @property
    def context_length(self) -> int:
        """The most tokens a sequence may hold (nanoGPT's and our checkpoints' `block_size`)."""
        return self.block_size

    @property
    def head_dim(self) -> int:
        return self.head_size or self.n_embd // self.n_head

    @property
    def rope_dim(self) -> int:
        """The leading channels of each query and key head that rotate (`rotary_dim`)."""
        return self.rotary_dim or self.head_dim

    @property
    def kv_heads(self) -> int:
        """Key/value heads: each serves n_head // kv_heads query heads."""
        return self.n_kv_head or self.n_head

    @property
    def gated_mlp(self) -> bool:
        """Whether the feed-forward block is gated (SwiGLU, GeGLU): c_fc's outputs are the gate,
        then the up projection."""
        return self.activation in ("swiglu", "geglu")

    @property
    def mlp_width(self) -> int:
        return self.intermediate_size or 4 * self.n_embd

    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's attention window in tokens (`sliding_window`), None for a global layer."""
        if self.sliding_window is None:
            return (None,) * self.n_layer
        if self.layer_types is None:
            return (self.sliding_window,) * self.n_layer
        return tuple(
            self.sliding_window if kind == "sliding_attention" else None
            for kind in self.layer_types
        )

    def local_rope_layers(self) -> tuple[bool, ...] | None:
        """Which layers rotate by `rope_local_theta` (the "sliding_attention" ones); None when
        every layer rotates alike."""
        if self.rope_local_theta is None or self.layer_types is None:
            return None
        return tuple(kind == "sliding_attention" for kind in self.layer_types)

    @property
    def query_scale(self) -> float:
        """What queries are multiplied by so that attention's usual 1 / sqrt(head_dim) scale
        makes 1 / sqrt(query_pre_attn_scalar): 1.0 unless that is set."""
        if self.query_pre_attn_scalar is None:
            return 1.0
        return (self.head_dim / self.query_pre_attn_scalar) ** 0.5

    @property
    def attn_bias(self) -> bool:
        return self.bias if self.qkv_bias is None else self.qkv_bias

    def validate(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        for name in ("n_kv_head", "head_size", "intermediate_size", "rotary_dim"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or value <= 0
            ):
                raise ConfigError(f"{name} must be a positive integer or null, got {value!r}")
        if self.head_size is None and self.n_embd % self.n_head != 0:
            raise ConfigError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.n_head % self.kv_heads != 0:
            raise ConfigError(
                f"n_head ({self.n_head}) must be a multiple of n_kv_head ({self.kv_heads})"
            )
        if self.sliding_window is not None and (
            not isinstance(self.sliding_window, int)
            or isinstance(self.sliding_window, bool)
            or self.sliding_window <= 0
        ):
            raise ConfigError(
                f"sliding_window must be a positive integer or null, got {self.sliding_window!r}"
            )
        if self.layer_types is not None:
            if len(self.layer_types) != self.n_layer:
                raise ConfigError(
                    f"layer_types names {len(self.layer_types)} layers, the model has {self.n_layer}"
                )
            bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if bad:
                raise ConfigError(f"layer_types must be among {LAYER_TYPES}, got {bad}")
        if self.norm not in NORMS:
            raise ConfigError(f"norm must be one of {NORMS}, got {self.norm!r}")
        if self.pos_encoding == "rotary" and self.head_dim % 2 != 0:
            raise ConfigError(f"rotary positions need an even head dim, got {self.head_dim}")
        if self.rotary_dim is not None and (
            self.pos_encoding != "rotary"
            or self.rotary_dim % 2 != 0
            or self.rotary_dim > self.head_dim
        ):
            raise ConfigError(
                f"rotary_dim must be an even number of channels up to head_dim ({self.head_dim}) "
                f"with pos_encoding 'rotary', got {self.rotary_dim}"
            )
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type"))
            if kind not in ROPE_SCALINGS:
                raise ConfigError(
                    f"rope_scaling type {kind!r} is not supported (supported: "
                    f"{', '.join(ROPE_SCALINGS)})"
                )
            if kind == "longrope":
                short = self.rope_scaling.get("short_factor")
                if not isinstance(short, list) or len(short) != self.rope_dim // 2:
                    raise ConfigError(
                        f"longrope's short_factor must be a list of rotary_dim / 2 = "
                        f"{self.rope_dim // 2} numbers"
                    )
                if not isinstance(self.rope_scaling.get("attention_factor"), (int, float)):
                    raise ConfigError("longrope's attention_factor must be a number")
        for name in ("embed_scale", "rope_local_theta", "query_pre_attn_scalar", "logit_softcap"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0
            ):
                raise ConfigError(f"{name} must be a positive number or null, got {value!r}")
        if self.query_pre_attn_scalar is not None and not (
            self.qk_norm and self.norm == "gemma_rmsnorm"
        ):
            raise ConfigError(
                "query_pre_attn_scalar needs qk_norm and norm 'gemma_rmsnorm' (the query norm "
                "applies it)"
            )
        if self.rope_local_theta is not None and (
            self.pos_encoding != "rotary" or self.layer_types is None
        ):
            raise ConfigError("rope_local_theta needs pos_encoding 'rotary' and layer_types")
        if self.sandwich_norm and self.norm_position != "pre":
            raise ConfigError("sandwich_norm needs norm_position 'pre'")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"dropout must be in [0, 1), got {self.dropout!r}")
        if self.pos_encoding not in POS_ENCODINGS:
            raise ConfigError(
                f"pos_encoding must be one of {POS_ENCODINGS}, got {self.pos_encoding!r}"
            )
        if self.norm_position not in NORM_POSITIONS:
            raise ConfigError(
                f"norm_position must be one of {NORM_POSITIONS}, got {self.norm_position!r}"
            )
        if self.activation not in ACTIVATIONS:
            raise ConfigError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if self.pos_encoding == "sinusoidal" and self.n_embd % 2 != 0:
            raise ConfigError(f"sinusoidal positions need an even n_embd, got {self.n_embd}")

    def to_dict(self) -> dict[str, Any]:
        return {"format": "gptserve", **asdict(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known - {"format"})
        if unknown:
            raise ConfigError(f"unknown config keys: {', '.join(unknown)}")
        try:
            return cls(**{k: v for k, v in data.items() if k in known})
        except TypeError as exc:  # wrong value types reach dataclass init
            raise ConfigError(str(exc)) from None

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def from_json(cls, path: str | Path) -> ModelConfig:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"cannot read model config {path}: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"model config {path} is not a JSON object")
        return cls.from_dict(data)
