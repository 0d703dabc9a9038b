"""Server settings: one dataclass, filled from the command line (and GPTSERVE_API_KEYS)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field, fields
from pathlib import Path

from server import DEFAULT_MODEL_DIR

API_KEYS_ENV = "GPTSERVE_API_KEYS"


class SettingsError(ValueError):
    """A flag value the server cannot run with."""


@dataclass
class Settings:
    model: str | None = None  # checkpoint directory; None: the bundled default model
    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: list[str] = field(default_factory=list)  # empty: no authentication
    served_model_name: str | None = None  # None: the checkpoint directory's name
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto | float32 | float16 | bfloat16 (auto: float32 on CPU, bf16 on CUDA)
    # engine
    max_num_seqs: int = 32
    max_queue: int = 256
    max_batch_tokens: int = 512
    block_size: int = 16
    kv_cache_gb: float = 2.0
    # per-request limits (None: the model's context length)
    max_logprobs: int = 20
    max_prompt_tokens: int | None = None
    max_tokens_limit: int | None = None
    max_n: int = 8
    max_prompts: int = 16
    max_stop: int = 4
    max_stop_length: int = 64
    max_logit_bias: int = 300
    max_body_bytes: int = 1_000_000
    max_concurrent_requests: int = 512
    request_timeout: float = 600.0
    body_timeout: float = 30.0
    shutdown_grace: float = 30.0
    log_level: str = "info"

    @property
    def model_path(self) -> Path:
        return Path(self.model) if self.model else DEFAULT_MODEL_DIR

    def validate(self) -> Settings:
        """Raise SettingsError for the first unusable value; returns self."""
        positive = (
            "max_num_seqs", "max_queue", "max_batch_tokens", "block_size", "max_n", "max_prompts",
            "max_body_bytes", "max_concurrent_requests",
        )  # fmt: skip
        for name in positive:
            if getattr(self, name) < 1:
                raise SettingsError(f"--{name.replace('_', '-')} must be >= 1")
        for name in ("max_prompt_tokens", "max_tokens_limit"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise SettingsError(f"--{name.replace('_', '-')} must be >= 1")
        for name in ("max_stop", "max_stop_length", "max_logit_bias"):
            if getattr(self, name) < 0:
                raise SettingsError(f"--{name.replace('_', '-')} must be >= 0")
        if not 0 <= self.max_logprobs <= 20:
            raise SettingsError("--max-logprobs must be between 0 and 20")
        for name in ("kv_cache_gb", "request_timeout", "body_timeout"):
            if not getattr(self, name) > 0:
                raise SettingsError(f"--{name.replace('_', '-')} must be > 0")
        if self.shutdown_grace < 0:
            raise SettingsError("--shutdown-grace must be >= 0")
        if not 0 <= self.port <= 65535:
            raise SettingsError("--port must be in [0, 65535]")
        if any(not key for key in self.api_keys):
            raise SettingsError("API keys must be non-empty")
        return self


def build_parser() -> argparse.ArgumentParser:
    d = Settings()
    p = argparse.ArgumentParser(
        prog="python -m server",
        description="Serve a gptserve or Hugging Face GPT-2 checkpoint over an OpenAI-compatible API.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--model", help=f"checkpoint directory (default: the bundled {DEFAULT_MODEL_DIR})"
    )
    p.add_argument("--host", default=d.host, help="address to bind")
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument(
        "--api-key", dest="api_keys", action="append", default=[],
        help=f"accepted Bearer key (repeatable; also {API_KEYS_ENV}, comma-separated); none: open",
    )  # fmt: skip
    p.add_argument(
        "--served-model-name", help="model name in the API (default: checkpoint dir name)"
    )
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default=d.device)
    p.add_argument(
        "--dtype", choices=["auto", "float32", "float16", "bfloat16"], default=d.dtype,
        help="auto: float32 on CPU, bfloat16 on CUDA",
    )  # fmt: skip
    p.add_argument(
        "--max-num-seqs", type=int, default=d.max_num_seqs, help="sequences decoding together"
    )
    p.add_argument(
        "--max-queue", type=int, default=d.max_queue, help="waiting sequences before 429"
    )
    p.add_argument(
        "--max-batch-tokens", type=int, default=d.max_batch_tokens, help="tokens per engine step"
    )
    p.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV cache block")
    p.add_argument(
        "--kv-cache-gb", type=float, default=d.kv_cache_gb, help="KV cache memory bound (GiB)"
    )
    p.add_argument(
        "--max-logprobs", type=int, default=d.max_logprobs, help="cap on logprobs/top_logprobs"
    )
    p.add_argument(
        "--max-prompt-tokens", type=int, help="prompt tokens per request (default: context length)"
    )
    p.add_argument(
        "--max-tokens-limit", type=int, help="max_tokens per request (default: context length)"
    )
    p.add_argument("--max-n", type=int, default=d.max_n, help="completions per prompt")
    p.add_argument(
        "--max-prompts", type=int, default=d.max_prompts, help="prompts in one completions request"
    )
    p.add_argument("--max-stop", type=int, default=d.max_stop, help="stop strings per request")
    p.add_argument(
        "--max-stop-length", type=int, default=d.max_stop_length, help="characters per stop string"
    )
    p.add_argument(
        "--max-logit-bias", type=int, default=d.max_logit_bias, help="logit_bias entries"
    )
    p.add_argument(
        "--max-body-bytes", type=int, default=d.max_body_bytes, help="request body size (413 above)"
    )
    p.add_argument(
        "--max-concurrent-requests", type=int, default=d.max_concurrent_requests,
        help="HTTP requests in flight (503 above)",
    )  # fmt: skip
    p.add_argument(
        "--request-timeout", type=float, default=d.request_timeout, help="seconds per request"
    )
    p.add_argument(
        "--body-timeout", type=float, default=d.body_timeout,
        help="seconds for a client to send its whole request body (408 after)",
    )  # fmt: skip
    p.add_argument(
        "--shutdown-grace", type=float, default=d.shutdown_grace, help="seconds to drain on SIGTERM"
    )
    p.add_argument(
        "--log-level",
        choices=["critical", "error", "warning", "info", "debug"],
        default=d.log_level,
    )
    return p


def settings_from_args(
    argv: list[str] | None = None, env: dict[str, str] | None = None
) -> Settings:
    """Parse flags (argparse exits 2 on unknown ones); raises SettingsError for bad values."""
    args = vars(build_parser().parse_args(argv))
    env = os.environ if env is None else env
    keys = list(args.pop("api_keys"))
    keys += [k.strip() for k in env.get(API_KEYS_ENV, "").split(",") if k.strip()]
    known = {f.name for f in fields(Settings)}
    return Settings(api_keys=keys, **{k: v for k, v in args.items() if k in known}).validate()
