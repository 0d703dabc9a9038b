"""TrainConfig: every setting of a run, typed, validated once and never changed afterwards."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Literal

from gptserve.model import ConfigError, ModelConfig
from gptserve.model.lora.modules import TARGETS
from gptserve.training.errors import TrainError

# The fields that make two runs the same model; --resume cannot change them, and --init-from
# takes them from its checkpoint (but block_size, there the training window).
ARCH_KEYS = (
    "arch",
    "n_layer",
    "n_head",
    "n_embd",
    "block_size",
    "pos_encoding",
    "activation",
    "norm_position",
    "n_kv_head",
    "head_size",
    "intermediate_size",
    "rope_theta",
    "qk_norm",
    "tie_embeddings",
)
ARCHS = ("gpt2", "llama")
GPT2_ONLY_KEYS = ("pos_encoding", "activation", "norm_position")  # GPT-2's variants
LLAMA_ONLY_KEYS = ("n_kv_head", "rope_theta", "qk_norm")
DEFAULT_BLOCK_SIZE = 256
LORA_TARGETS = (*TARGETS, "all")
# what --resume cannot change of a LoRA run: the adapter's shape, its scaling and its base
LORA_KEYS = ("lora_rank", "lora_alpha", "lora_targets", "init_from")
PATH_KEYS = ("data", "out", "cache_dir", "init_from", "val_data")
POSITIVE_KEYS = (
    "max_steps",
    "batch_size",
    "grad_accum",
    "eval_interval",
    "eval_iters",
    "log_interval",
    "n_layer",
    "n_head",
    "n_embd",
    "block_size",
    "n_kv_head",
    "head_size",
    "intermediate_size",
    "lora_rank",
)
NON_NEGATIVE_KEYS = ("warmup_steps", "sample_tokens", "weight_decay", "grad_clip", "min_lr")


@dataclass(frozen=True)
class TrainConfig:
    out: Path
    data: Path
    # chat data (training/chat_data.py): --data FILE.jsonl, or any --data with chat_data set
    chat_data: bool = False
    val_data: Path | None = None  # chat: the validation examples (else the last val_fraction)
    cache_dir: Path | None = None  # None: OUT/cache
    max_steps: int = 5000
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    compile: bool = False
    # model (ignored with init_from, which brings its own architecture)
    arch: Literal["gpt2", "llama"] = "gpt2"
    n_layer: int = 6
    n_head: int = 6
    n_embd: int = 384
    # the training window and a new model's context length; None: DEFAULT_BLOCK_SIZE, or with
    # init_from the checkpoint's context length up to MAX_FINE_TUNE_WINDOW (training/setup.py)
    block_size: int | None = None
    dropout: float = 0.0
    # GPT-2's variants; a Llama-shaped model is rotary, SwiGLU and pre-norm (saved as such)
    pos_encoding: Literal["learned", "sinusoidal", "rotary"] = "learned"
    activation: Literal["gelu", "relu", "swiglu"] = "gelu"
    norm_position: Literal["pre", "post"] = "pre"
    # Llama's fields (n_kv_head, rope_theta, qk_norm: arch "llama" only)
    n_kv_head: int | None = None  # None: n_head (no grouped-query attention)
    head_size: int | None = None  # None: n_embd // n_head
    intermediate_size: int | None = None  # None: 4 x n_embd (gpt2), llama_mlp_width (llama)
    rope_theta: float = 10000.0
    qk_norm: bool = False
    tie_embeddings: bool = True  # lm_head shares wte (the embedding is most of a small model)
    init_from: Path | None = None
    # LoRA (--lora-rank): low-rank pairs trained on a frozen --init-from base (training/lora.py)
    lora_rank: int | None = None
    lora_alpha: float | None = None  # None: 2 x lora_rank
    lora_targets: tuple[str, ...] | None = None  # None: the family's default (training/lora.py)
    lora_dropout: float = 0.0
    merge: bool = False  # also write OUT/merged, the base with the adapter added in
    # optimization
    batch_size: int = 8
    grad_accum: int = 1
    lr: float = 6e-4
    min_lr: float | None = None  # None: lr / 10
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # 0: off
    seed: int = 1337
    threads: int | None = None  # None: torch's choice
    # evaluation and output
    eval_interval: int = 250
    eval_iters: int = 20
    log_interval: int = 10
    sample_tokens: int = 48
    val_fraction: float = 0.1
    save_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    resume: bool = False  # this run continues the one saved in out

    def __post_init__(self) -> None:
        for key in POSITIVE_KEYS:
            value = getattr(self, key)
            if value is not None and value <= 0:
                raise TrainError(f"--{flag(key)} must be positive, got {value}")
        for key in ("lr", "rope_theta"):
            if not getattr(self, key) > 0:
                raise TrainError(f"--{flag(key)} must be positive, got {getattr(self, key)}")
        for key in NON_NEGATIVE_KEYS:
            value = getattr(self, key)
            if value is not None and value < 0:
                raise TrainError(f"--{flag(key)} must be >= 0, got {value}")
        if not 0.0 <= self.val_fraction < 1.0:
            raise TrainError(f"--val-fraction must be in [0, 1), got {self.val_fraction}")
        if self.threads is not None and self.threads <= 0:
            raise TrainError(f"--threads must be positive, got {self.threads}")
        self._check_lora()
        if self.val_data is not None and not self.chat:
            raise TrainError(
                "--val-data needs chat data (--data FILE.jsonl, or --chat-data); text data "
                "holds out its last --val-fraction"
            )
        if not self.init_from:
            try:
                self.model_config()
            except ConfigError as exc:
                raise TrainError(str(exc)) from None

    def _check_lora(self) -> None:
        """The LoRA flags make sense together (and the architecture's targets are checked once
        the base is loaded)."""
        if self.lora_rank is None:
            given = [
                k
                for k, off in (("lora_alpha", None), ("lora_targets", None), ("merge", False))
                if getattr(self, k) != off
            ] + (["lora_dropout"] if self.lora_dropout != 0.0 else [])
            if given:
                raise TrainError(f"--{flag(given[0])} needs --lora-rank")
            return
        if self.init_from is None:
            raise TrainError("--lora-rank needs --init-from BASE: the frozen model it adapts")
        if self.lora_alpha is not None and not self.lora_alpha > 0:
            raise TrainError(f"--lora-alpha must be positive, got {self.lora_alpha}")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise TrainError(f"--lora-dropout must be in [0, 1), got {self.lora_dropout}")
        names = self.lora_targets
        unknown = [t for t in names or () if t not in LORA_TARGETS]
        if names is not None and (unknown or not names or (len(names) > 1 and "all" in names)):
            shown = ",".join(unknown) or ",".join(names)
            raise TrainError(
                f"--lora-targets {shown!r}: choose from {','.join(LORA_TARGETS[:-1])} "
                "(comma-separated) or 'all'"
            )
        if self.merge and Path(self.init_from).suffix == ".gguf":
            raise TrainError(
                "--merge cannot write a GGUF base's tokenizer into a checkpoint; serve the "
                "adapter on the GGUF file instead (gptserve serve --model FILE.gguf --lora "
                "NAME=OUT)"
            )

    @property
    def chat(self) -> bool:
        """Whether --data is chat examples (a .jsonl file, or --chat-data) rather than text."""
        return self.chat_data or Path(self.data).suffix == ".jsonl"

    @property
    def alpha(self) -> float:
        """LoRA's alpha: --lora-alpha, else twice --lora-rank (scaling alpha / rank = 2)."""
        assert self.lora_rank is not None
        return float(self.lora_alpha) if self.lora_alpha is not None else 2.0 * self.lora_rank

    @property
    def final_lr(self) -> float:
        """Where the cosine schedule ends: --min-lr, else a tenth of --lr."""
        return self.lr / 10 if self.min_lr is None else self.min_lr

    @property
    def token_cache(self) -> Path:
        return self.cache_dir if self.cache_dir is not None else self.out / "cache"

    def model_config(self, vocab_size: int = 50257) -> ModelConfig:
        """The model these flags describe (not used with init_from): GPT-2 and its variants, or
        a Llama-shaped model (rotary positions, RMSNorm, SwiGLU, no biases; GPT-2's tokenizer)."""
        shared = dict(
            vocab_size=vocab_size,
            block_size=self.block_size or DEFAULT_BLOCK_SIZE,
            n_layer=self.n_layer,
            n_head=self.n_head,
            n_embd=self.n_embd,
            dropout=self.dropout,
            head_size=self.head_size,
            tie_embeddings=self.tie_embeddings,
        )
        if self.arch == "gpt2":
            return ModelConfig(
                **shared,
                intermediate_size=self.intermediate_size,
                pos_encoding=self.pos_encoding,
                activation=self.activation,
                norm_position=self.norm_position,
            )
        return ModelConfig(
            **shared,
            intermediate_size=self.intermediate_size or llama_mlp_width(self.n_embd),
            bias=False,
            pos_encoding="rotary",
            norm="rmsnorm",
            activation="swiglu",
            norm_position="pre",
            n_kv_head=self.n_kv_head,
            rope_theta=self.rope_theta,
            qk_norm=self.qk_norm,
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain values only (paths as strings): train_state.pt is read with weights_only=True."""
        d = asdict(self)
        return {k: str(v) if k in PATH_KEYS and v is not None else v for k, v in d.items()}


def field_names() -> set[str]:
    return {f.name for f in fields(TrainConfig)}


def flag(key: str) -> str:
    """ "max_steps" -> "max-steps"."""
    return key.replace("_", "-")


def llama_mlp_width(n_embd: int) -> int:
    """SwiGLU's width as Llama sizes it: 8/3 x n_embd (three matrices then hold what GPT-2's
    two of 4 x n_embd hold), rounded up to a multiple of 64; 1024 at width 384."""
    return -(-8 * n_embd // (3 * 64)) * 64


def model_flags(config: ModelConfig) -> dict[str, Any]:
    """The architecture flags (ARCH_KEYS) that describe `config`, saved with a run for --resume;
    a checkpoint's fields that no flag sets (biases, rope scaling, ...) stay in its config."""
    return {
        "arch": "llama" if config.pos_encoding == "rotary" else "gpt2",
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_embd": config.n_embd,
        "block_size": config.block_size,
        "pos_encoding": config.pos_encoding,
        "activation": config.activation,
        "norm_position": config.norm_position,
        "n_kv_head": config.n_kv_head,
        "head_size": config.head_size,
        "intermediate_size": config.intermediate_size,
        "rope_theta": config.rope_theta,
        "qk_norm": config.qk_norm,
        "tie_embeddings": config.tie_embeddings,
    }


def arch(config: ModelConfig) -> dict[str, Any]:
    """The fields that make two model configs the same model (dropout is a training choice)."""
    return {k: v for k, v in asdict(config).items() if k != "dropout"}
