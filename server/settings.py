"""Server settings: one dataclass whose fields define the command line too.

Each field carries its flag's help text, group and allowed range in its metadata; `build_parser`
makes the argparse parser from the fields, and `Settings.validate` checks the ranges. A new flag
is a new field here and nothing else.
"""

from __future__ import annotations

import argparse
import os
import typing
from dataclasses import MISSING, Field, dataclass, field, fields
from pathlib import Path
from typing import Any

from gptserve.engine.pooling import POOLING_MODES
from gptserve.engine.scheduler import TENANT_STEP_PREFILL
from gptserve.model import SHAKESPEARE_DIR
from gptserve.model.known_models import cache_dir, cached_path, known_name
from gptserve.server.chat.reasoning import PARSER_NAMES as REASONING_PARSERS
from gptserve.server.chat.tools.formats import PARSER_NAMES

API_KEYS_ENV = "GPTSERVE_API_KEYS"
ADMIN_API_KEYS_ENV = "GPTSERVE_ADMIN_API_KEYS"
GROUPS = {
    "server": "server",
    "engine": "engine",
    "limits": "request limits (each enforced with an OpenAI-shaped error)",
    "fine-tuning": "fine-tuning (OpenAI's files and fine-tuning jobs)",
}
LIMITS_GROUP = GROUPS["limits"]
# without --kv-cache-gb the KV pool holds this many full contexts, or this many tokens for each
# of --max-num-seqs sequences where that is more (at most 2 GiB)
DEFAULT_KV_CONTEXTS = 2
DEFAULT_KV_TOKENS_PER_SEQ = 512


class SettingsError(ValueError):
    """A flag value the server cannot run with."""


def flag(
    default: Any,
    help: str,
    *,
    group: str = "server",
    low: float | None = None,
    high: float | None = None,
    positive: bool = False,
    choices: tuple[str, ...] | None = None,
    name: str | None = None,
) -> Any:
    """A Settings field with its command-line flag: `low`/`high` bound it (inclusive), `positive`
    asks for > 0, `name` overrides the flag's name (default: the field's, with dashes)."""
    meta = {
        "help": help, "group": group, "low": low, "high": high, "positive": positive,
        "choices": choices, "name": name,
    }  # fmt: skip
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class Settings:
    model: str | None = flag(
        None,
        "a checkpoint directory, a GGUF file, or a known model's name: "
        "smollm2-135m-instruct (the default; fetched once) or shakespeare (bundled); "
        "NAME=PATH names it; repeatable: several models, a request's model picks one (the "
        "first is the default)",
    )
    # the second and later --model flags (its own flag, --extra-model, is hidden)
    extra_models: list[str] = flag([], "", name="extra-model")
    models_dir: str | None = flag(
        None, "serve every model in this folder: each GGUF file (named by its stem), Hugging "
        "Face directory and train.py output (named by the folder's name), loaded on demand",
    )  # fmt: skip
    preload: list[str] = flag(
        [], "a model to load at start rather than on its first request (repeatable); a single "
        "--model always loads at start",
    )  # fmt: skip
    keep_alive: float = flag(
        300.0, "with several models: seconds a loaded model stays loaded with no running or "
        "queued request before it unloads; -1: never", low=-1,
    )  # fmt: skip
    max_loaded_models: int | None = flag(
        None, "with several models: models loaded at once; loading one more first unloads the "
        "least recently used idle one", low=1,
    )  # fmt: skip
    max_loaded_gb: float | None = flag(
        None, "with several models: a memory budget (GiB) for the loaded models' weights and "
        "KV caches (estimated); loading past it first unloads the least recently used idle "
        "ones", positive=True,
    )  # fmt: skip
    host: str = flag(
        "127.0.0.1", "address to bind; on a loopback address only loopback Host headers are "
        "answered (see --allowed-host); on another, set --api-key",
    )  # fmt: skip
    allowed_hosts: list[str] = flag(
        [], "a Host header name answered besides the loopback names when --host is a loopback "
        "address (repeatable; * answers any): a reverse proxy's name", name="allowed-host",
    )  # fmt: skip
    port: int = flag(8000, "port to bind", low=0, high=65535)
    api_keys: list[str] = flag(
        [], f"accepted Bearer key (repeatable; also {API_KEYS_ENV}, comma-separated); none: open",
        name="api-key",
    )  # fmt: skip
    admin_api_keys: list[str] = flag(
        [], "an accepted Bearer key that may also load and unload LoRA adapters (the admin "
        f"scope; repeatable; also {ADMIN_API_KEYS_ENV}, comma-separated); with API keys but "
        "none of these, nobody may", name="admin-api-key",
    )  # fmt: skip
    served_model_name: str | None = flag(
        None, "model name in the API (default: the checkpoint directory's name)"
    )
    chat_template: str | None = flag(
        None, "a Jinja chat template file used instead of the checkpoint's own"
    )
    reasoning_parser: str | None = flag(
        None, "how the model writes its reasoning, returned apart as reasoning_content: qwen3 "
        "(<think>...</think> before the answer) or deepseek_r1 (the prompt opens <think>, the "
        "answer closes it); default: what the chat template writes (none when it writes no "
        "<think>)", choices=REASONING_PARSERS,
    )  # fmt: skip
    tool_call_parser: str | None = flag(
        None, "how the model writes tool calls: hermes (<tool_call>{...}</tool_call>) or "
        "llama3_json (a bare JSON object); default: what the chat template writes (llama3_json "
        "for a Llama 3 template, else hermes)", choices=PARSER_NAMES,
    )  # fmt: skip
    device: str = flag("auto", "auto: CUDA if available", choices=("auto", "cpu", "cuda"))
    dtype: str = flag(
        "auto", "auto: float32 on CPU, bfloat16 on CUDA",
        choices=("auto", "float32", "float16", "bfloat16"),
    )  # fmt: skip
    quantize: str = flag(
        "none", "weight quantization at load: int8 = int8 weights, a scale per output channel, "
        "for the layer matrices and the head, their input rows rounded to 8 bits per block of 32 "
        "on a CPU (there with --dtype float32 or bfloat16); none "
        "keeps a GGUF file's Q4_0, Q4_1, Q4_K and Q8_0 matrices at their own bits on a CPU "
        "(Q5_K and Q6_K become int8 rows, requantized); dequantize = a GGUF file's weights as "
        "float",
        choices=("none", "int8", "dequantize"),
    )  # fmt: skip
    int8_activations: bool = flag(
        False, "a GGUF file's int4 products (Q4_0, Q4_1, Q4_K, Q8_0 matrices) round their input "
        "rows to 8 bits per block of 32 and multiply bytes, as llama.cpp does: about 2x faster "
        "products on AVX2 CPUs, but the answers are no longer the float32 oracle's "
        "(docs/BENCHMARKS.md measures how far); CPU only", group="engine",
    )  # fmt: skip
    log_level: str = flag(
        "info", "log level", choices=("critical", "error", "warning", "info", "debug")
    )
    log_format: str = flag(
        "text", "log lines as text (time, level, logger, the request's X-Request-Id, message) or "
        "json (one object a line; a finished request's line has its model, tokens and timings)",
        choices=("text", "json"),
    )  # fmt: skip
    otlp_traces_endpoint: str | None = flag(
        None, "send a span per request (OpenTelemetry's GenAI attributes, the caller's "
        "traceparent continued) to this OTLP HTTP/protobuf URL, e.g. "
        "http://localhost:4318/v1/traces (a URL without a path gets /v1/traces); needs "
        "pip install 'gptserve[otel]'",
    )  # fmt: skip
    shutdown_grace: float = flag(30.0, "seconds in-flight requests get after SIGTERM", low=0)
    stream_interval: int = flag(
        1, "a streamed completion's tokens per SSE chunk after its first token (which is sent "
        "at once): more means fewer, larger chunks and less work per token (gptserve.server.ray.cli "
        "defaults to 4: there each chunk crosses Ray Serve's proxy)", low=1,
    )  # fmt: skip
    exit_on_engine_failure: bool = flag(
        False, "exit with status 1 once the engine is unhealthy (see "
        "--max-consecutive-failed-steps) or its thread has died, so that a process manager "
        "restarts the server",
    )  # fmt: skip
    prefix_cache_scope: str = flag(
        "key", "who shares cached prompt prefixes: key = the requests of one API key (without "
        "--api-key everyone is one tenant); global = every client, which lets a client tell "
        "from cached_tokens and its latency what other clients sent; a request's cache_salt "
        "narrows either", choices=("key", "global"),
    )  # fmt: skip
    # engine
    max_num_seqs: int = flag(32, "sequences decoding together", group="engine", low=1)
    max_batch_tokens: int = flag(
        512, "tokens per engine step (prefill chunk bound)", group="engine", low=1
    )
    tenant_step_tokens: int = flag(
        TENANT_STEP_PREFILL, "with API keys: a step's prompt chunks cost at most this many tokens at a prompt's "
        "start, fewer deep into it, so another key's request waits at most a short step "
        "(0: --max-batch-tokens only)", group="engine", low=0,
    )  # fmt: skip
    block_size: int = flag(16, "tokens per KV cache block", group="engine", low=1)
    kv_cache_gb: float | None = flag(
        None, f"KV cache size (GiB); a request larger than the pool is a 400. Default: "
        f"{DEFAULT_KV_CONTEXTS} of the model's full contexts or {DEFAULT_KV_TOKENS_PER_SEQ} "
        "tokens for each of --max-num-seqs, whichever is more, at most 2 GiB. On a CPU the pool "
        "takes memory as its blocks are first written, not at start",
        group="engine", positive=True,
    )  # fmt: skip
    kv_cache_dtype: str = flag(
        "auto", "the KV cache's dtype; auto: the model's. float16 or bfloat16 under a float32 "
        "model holds twice the tokens in --kv-cache-gb and halves what the decode attention "
        "reads (llama.cpp's default cache is float16), at the cost of rounding each cached key "
        "and value: outputs move by that rounding; a cache is the model's dtype or 16-bit under "
        "a float32 model", group="engine",
        choices=("auto", "float32", "float16", "bfloat16"),
    )  # fmt: skip
    speculative: str | None = flag(
        None, "speculative decoding by prompt lookup (no second model); see also --draft-model",
        group="engine", choices=("ngram",),
    )  # fmt: skip
    draft_model: str | None = flag(
        None, "checkpoint of a smaller model with the same tokenizer: speculative decoding with "
        "its guesses", group="engine",
    )  # fmt: skip
    num_speculative_tokens: int = flag(
        4, "guesses verified per sequence and step", group="engine", low=1, high=16
    )
    no_prefix_cache: bool = flag(
        False, "turn off automatic prefix caching (reusing the KV blocks of prompt prefixes "
        "seen before)", group="engine",
    )  # fmt: skip
    batch_invariant: bool = flag(
        False, "a request's tokens and logprobs do not depend on what else runs in its batch, "
        "to the bit, in float32, bfloat16, int8 and a GGUF file's bits: float32 products of a few rows keep oneDNN's kernel "
        "(not the compiled tiles), the CPU decode attention keeps the cache's dtype and int8 "
        "products keep their kernel at every row count, which slows few-stream float32, "
        "bfloat16 and large int8 batches (docs/RELIABILITY.md); CPU only, not with "
        "speculative decoding", group="engine",
    )  # fmt: skip
    pooling: str | None = flag(
        None, "how /v1/embeddings pools the final hidden states: last = the last token's "
        "(Qwen3-Embedding's way), mean = the mean over the prompt's tokens, either L2-normalized; "
        "default: the checkpoint's sentence-transformers 1_Pooling/config.json when it has one, "
        "else last", group="engine", choices=POOLING_MODES,
    )  # fmt: skip
    max_consecutive_failed_steps: int = flag(
        3, "engine steps failing in a row after which the engine takes no more work: /health "
        "and new requests answer 503 engine_unhealthy (a step that succeeds resets the count)",
        group="engine", low=1,
    )  # fmt: skip
    lora: list[str] = flag(
        [], "a LoRA adapter to serve as NAME=DIR (a PEFT adapter directory: adapter_config.json "
        "and adapter_model.safetensors; repeatable): a request whose model is NAME runs with it, "
        "in the same batches as the base model's", group="engine",
    )  # fmt: skip
    max_loras: int = flag(
        4, "LoRA adapters loaded at once (slots; --lora and /v1/load_lora_adapter share them)",
        group="engine", low=1, high=64,
    )  # fmt: skip
    max_lora_rank: int = flag(
        64, "the largest LoRA rank an adapter may have (a larger one is refused when it loads)",
        group="engine", low=1, high=1024,
    )  # fmt: skip
    lora_dtype: str = flag(
        "auto", "the LoRA adapters' weights and products; auto: float32 on a CPU (as PEFT "
        "computes adapters; PyTorch's bfloat16 products of a few rows are slower there), the "
        "model's dtype on a GPU", group="engine", choices=("auto", "float32", "bfloat16", "float16"),
    )  # fmt: skip
    enable_lora_loading: bool = flag(
        False, "answer POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's: load and "
        "unload adapters while serving); off: 404. With API keys only --admin-api-key keys "
        "may call them", group="engine",
    )  # fmt: skip
    lora_roots: list[str] = flag(
        [], "a directory /v1/load_lora_adapter may load adapters from (repeatable): a lora_path "
        "must resolve, symlinks followed, inside one; none: every lora_path is refused (400). "
        "--lora's adapters are not restricted", group="engine", name="lora-root",
    )  # fmt: skip
    enable_fine_tuning: bool = flag(
        False, "answer OpenAI's /v1/files and /v1/fine_tuning/jobs: upload chat JSONL, train "
        "LoRA adapters on the served model in a subprocess, serve each result as ft:BASE:... "
        "(see docs/API.md); off: 404", group="fine-tuning",
    )  # fmt: skip
    state_dir: str | None = flag(
        None, "where uploaded files, fine-tuning jobs and their adapters are kept across "
        "restarts (default: the cache directory's state/, e.g. ~/.cache/gptserve/state)",
        group="fine-tuning",
    )  # fmt: skip
    max_file_bytes: int = flag(
        50_000_000, "bytes of an uploaded file (413 above)", group="fine-tuning", low=1
    )
    fine_tune_threads: int = flag(
        1, "CPU threads of a fine-tuning job's process (OMP_NUM_THREADS and torch's); it also "
        "runs at a lower priority (nice 10)", group="fine-tuning", low=1,
    )  # fmt: skip
    fine_tune_max_steps: int | None = flag(
        None, "an upper bound on a job's optimizer steps (default: none, the epochs decide); "
        "a job cut short by it says so in its events", group="fine-tuning", low=1,
    )  # fmt: skip
    # per-request limits (None: the model's context length)
    max_queue: int = flag(256, "waiting sequences; at or above it 429", group="limits", low=1)
    max_logprobs: int = flag(
        20, "cap on logprobs / top_logprobs (400 above)", group="limits", low=0, high=20
    )
    max_prompt_tokens: int | None = flag(
        None, "prompt tokens per request (400 above; default: context length)",
        group="limits", low=1,
    )  # fmt: skip
    max_tokens_limit: int | None = flag(
        None, "max_tokens per request (400 above; default: context length)", group="limits", low=1
    )
    max_n: int = flag(8, "n per request (400 above)", group="limits", low=1)
    max_prompts: int = flag(
        16, "prompts in one completions request, inputs in one embeddings request (400 above)",
        group="limits", low=1,
    )  # fmt: skip
    max_stop: int = flag(4, "stop strings per request (400 above)", group="limits", low=0)
    max_stop_length: int = flag(64, "characters per stop string (400 above)", group="limits", low=0)
    max_logit_bias: int = flag(300, "logit_bias entries (400 above)", group="limits", low=0)
    max_body_bytes: int = flag(1_000_000, "request body bytes (413 above)", group="limits", low=1)
    responses_store_size: int = flag(
        1000, "responses kept per API key for previous_response_id and GET /v1/responses/{id} "
        "(least recently used dropped first; 0: none are kept)", low=0,
    )  # fmt: skip
    max_concurrent_requests: int = flag(
        512, "HTTP requests in flight (429 above; /health and /metrics not counted)",
        group="limits", low=1,
    )  # fmt: skip
    request_timeout: float = flag(
        600.0,
        "seconds per request: then it ends with what it generated, finish_reason length",
        group="limits",
        positive=True,
    )
    body_timeout: float = flag(
        30.0, "seconds for a client to send its whole request body (408 after)",
        group="limits", positive=True,
    )  # fmt: skip

    @property
    def model_name(self) -> str | None:
        """The known model --model names (model.known_models), or None for a path."""
        return known_name(self.model)

    @property
    def model_path(self) -> Path:
        """The path given, or where the known model lives (once fetched)."""
        name = self.model_name
        if name is None:
            return Path(self.model or ".")
        return SHAKESPEARE_DIR if name == "shakespeare" else cached_path(name)

    def validate(self) -> Settings:
        """Raise SettingsError for the first value outside its flag's range; returns self."""
        for f in fields(self):
            value, meta = getattr(self, f.name), f.metadata
            if value is None or isinstance(value, (str, list)):
                continue
            what = f"--{flag_name(f)}"
            low, high = meta["low"], meta["high"]
            if low is not None and high is not None:
                if not low <= value <= high:
                    raise SettingsError(f"{what} must be between {low} and {high}")
            elif low is not None and value < low:
                raise SettingsError(f"{what} must be >= {low}")
            if meta["positive"] and not value > 0:
                raise SettingsError(f"{what} must be > 0")
        if self.speculative and self.draft_model:
            raise SettingsError("--speculative ngram and --draft-model exclude each other")
        if self.batch_invariant and (self.speculative or self.draft_model):
            raise SettingsError(
                "--batch-invariant cannot hold with speculative decoding (whether a sequence "
                "guesses depends on how many others decode)"
            )
        if self.draft_model is not None and not Path(self.draft_model).is_dir():
            raise SettingsError(f"--draft-model: no checkpoint directory {self.draft_model}")
        self._validate_lora()
        if self.keep_alive < 0 and self.keep_alive != -1:
            raise SettingsError("--keep-alive must be >= 0, or -1 (never unload)")
        if self.models_dir is not None and not Path(self.models_dir).is_dir():
            raise SettingsError(f"--models-dir: no directory {self.models_dir}")
        if any(not key for key in self.auth_keys):
            raise SettingsError("API keys must be non-empty")
        if any(not root for root in self.lora_roots):
            raise SettingsError("--lora-root must name a directory")
        endpoint = self.otlp_traces_endpoint
        if endpoint is not None and not endpoint.startswith(("http://", "https://")):
            raise SettingsError(
                f"--otlp-traces-endpoint must be an http:// or https:// URL, not {endpoint!r}"
            )
        return self

    @property
    def serves_many(self) -> bool:
        """Whether this server serves several models (more than one --model, or --models-dir):
        then models load on demand and unload when idle (server.models)."""
        return bool(self.extra_models or self.models_dir)

    @property
    def auth_keys(self) -> list[str]:
        """Every accepted Bearer key: --api-key's and --admin-api-key's (none: an open server)."""
        return [*self.api_keys, *self.admin_api_keys]

    @property
    def lora_modules(self) -> dict[str, Path]:
        """--lora's adapters: name -> directory (after `validate`)."""
        return {n: Path(d) for n, _, d in (spec.partition("=") for spec in self.lora)}

    @property
    def fine_tuning_dir(self) -> Path:
        """--state-dir, else the cache directory's state/."""
        return Path(self.state_dir) if self.state_dir else cache_dir() / "state"

    @property
    def serves_lora(self) -> bool:
        """Whether the model gets LoRA slots: adapters at start or loaded later."""
        return bool(self.lora) or self.enable_lora_loading or self.enable_fine_tuning

    def _validate_lora(self) -> None:
        names = []
        for spec in self.lora:
            name, eq, directory = spec.partition("=")
            if not (eq and name.strip() and directory) or name != name.strip():
                raise SettingsError(f"--lora {spec!r}: expected NAME=DIR")
            names.append(name)
        if len(set(names)) != len(names):
            raise SettingsError("--lora: each adapter needs a name of its own")
        if len(names) > self.max_loras:
            raise SettingsError(f"--lora: {len(names)} adapters but --max-loras {self.max_loras}")
        if self.serves_lora and self.batch_invariant:
            raise SettingsError(
                "--batch-invariant cannot hold with LoRA adapters (an adapter's rows are "
                "computed together, as many as the batch has)"
            )
        if self.served_model_name is not None and self.served_model_name in names:
            raise SettingsError("--lora: an adapter cannot have the served model's name")


def split_named(spec: str) -> tuple[str | None, str]:
    """`NAME=PATH` -> (NAME, PATH); a plain path or known name -> (None, it). A `=` inside a
    path (after a slash) or in a path that exists is part of the path."""
    name, eq, source = spec.partition("=")
    if not eq or not name or not source or "/" in name or Path(spec).exists():
        return None, spec
    return name, source


def flag_name(f: Field) -> str:
    return f.metadata["name"] or f.name.replace("_", "-")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default unless it is None or empty (the help text says what that means)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, []):
            return action.help or ""
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    """The command line, made from the Settings fields."""
    parser = argparse.ArgumentParser(
        prog="gptserve serve",
        description="Serve a GPT-2 or Llama-family model (SmolLM2-135M-Instruct by default; a "
        "train.py directory, a Hugging Face directory or a GGUF file) over an OpenAI-compatible "
        "API.",
        formatter_class=_HelpFormatter,
    )
    groups = {key: parser.add_argument_group(title) for key, title in GROUPS.items()}
    hints = typing.get_type_hints(Settings)
    for f in fields(Settings):
        meta = f.metadata
        kwargs: dict[str, Any] = {"dest": f.name, "help": meta["help"] or argparse.SUPPRESS}
        if meta["choices"]:
            kwargs["choices"] = meta["choices"]
        else:
            kwargs["metavar"] = flag_name(f).upper().replace("-", "_")
        if f.name == "model":  # repeatable: the first is `model`, the others extra_models
            kwargs.update(action=_ModelFlag, default=None)
        elif f.default_factory is not MISSING:  # a list: a repeatable flag
            kwargs.update(action="append", default=[])
        elif hints[f.name] is bool:  # a switch
            kwargs.pop("metavar")
            kwargs.update(action="store_true", default=f.default)
        else:
            kwargs.update(type=_scalar_type(hints[f.name]), default=f.default)
        groups[meta["group"]].add_argument(f"--{flag_name(f)}", **kwargs)
    return parser


class _ModelFlag(argparse.Action):
    """--model: the first is the default model, each later one another model (extra_models)."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
        option_string: str | None = None,
    ) -> None:  # fmt: skip
        if namespace.model is None:
            namespace.model = values
        else:
            namespace.extra_models = [*namespace.extra_models, values]


def _scalar_type(hint: Any) -> type:
    """int for `int` and `int | None`, and so on."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if args else hint


def settings_from_args(
    argv: list[str] | None = None, env: dict[str, str] | None = None
) -> Settings:
    """Parse flags (argparse exits 2 on unknown ones); raises SettingsError for bad values."""
    values = vars(build_parser().parse_args(argv))
    if values["model"] and not values["extra_models"] and not values["models_dir"]:
        name, source = split_named(values["model"])  # one --model NAME=PATH: PATH named NAME
        values["model"] = source
        values["served_model_name"] = values["served_model_name"] or name
    env = os.environ if env is None else env
    values["api_keys"] += _env_keys(env, API_KEYS_ENV)
    values["admin_api_keys"] += _env_keys(env, ADMIN_API_KEYS_ENV)
    return Settings(**values).validate()


def _env_keys(env: typing.Mapping[str, str], name: str) -> list[str]:
    """The comma-separated keys of the environment variable `name`."""
    return [k.strip() for k in env.get(name, "").split(",") if k.strip()]
