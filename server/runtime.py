"""What a running server holds: the loaded model, the engine and its thread, and readiness.

There is one way to start: the app binds its port first, then `ServerState.start_loading` loads
the checkpoint and starts the engine in a background thread, so `/health` answers 503 "loading"
over HTTP while a large checkpoint loads and 200 once it serves.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from gptserve.engine.adapters import AdapterError, read_adapter
from gptserve.engine.async_engine import AsyncEngine
from gptserve.engine.engine import Engine, EngineConfig
from gptserve.engine.loader import ModelLoadError, check_load, load_for_inference
from gptserve.engine.pooling import EmbeddingSpec
from gptserve.kernels.paged_kv import cache_dtype
from gptserve.model import GPT, SHAKESPEARE_DIR
from gptserve.model.cpu.malloc_tuning import release_freed_memory
from gptserve.model.dtypes import DTYPES
from gptserve.model.known_models import FetchError, resolve_model
from gptserve.model.lora.adapter import LoraAdapter
from gptserve.model.lora.batched import LoraBank, LoraRankError, LoraShapeError, install_lora
from gptserve.model.tokenizers import Tokenizer
from gptserve.server.chat.templates import ChatFormat, load_chat_format
from gptserve.server.errors import APIError
from gptserve.server.metrics import Metrics
from gptserve.server.models.specs import check_preload, model_settings, model_specs
from gptserve.server.settings import DEFAULT_KV_CONTEXTS, DEFAULT_KV_TOKENS_PER_SEQ, Settings
from gptserve.server.validation import Validator

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    """What the server serves: the loaded model, the name it answers to, its chat template."""

    model: GPT
    tokenizer: Tokenizer
    name: str
    template: ChatFormat
    path: Path
    draft: GPT | None = None  # the draft model of speculative decoding (--draft-model)
    lora: LoraBank | None = None  # the model's LoRA slots (--lora, --enable-lora-loading)
    # --lora's adapters, read and checked: name -> (adapter, its directory)
    adapters: dict[str, tuple[LoraAdapter, Path]] = field(default_factory=dict)


def preflight(settings: Settings) -> None:
    """The checks that need no loading (directory, device, dtype with --quantize): `python -m
    server` runs them before it binds its port, so these mistakes exit at once. Raises
    ModelLoadError (SettingsError for a server of several models' names)."""
    if settings.serves_many:  # each --model's model; --models-dir's bad entries only log
        specs = model_specs(settings)
        check_preload(settings, [s.name for s in specs])
        flags = (1 if settings.model else 0) + len(settings.extra_models)
        for i, spec in enumerate(specs[:flags]):
            try:
                preflight(model_settings(settings, spec, default=i == 0))
            except ModelLoadError as exc:
                raise ModelLoadError(f"--model {spec.name}: {exc}") from None
        return
    path, name = settings.model_path, settings.model_name
    if name == "shakespeare" and not path.is_dir():
        raise ModelLoadError(f"the bundled shakespeare model is missing at {path}")
    if name is None and path.suffix == ".gguf" and not path.is_file():
        raise ModelLoadError(f"GGUF file {path} does not exist")
    if name is None and path.suffix != ".gguf" and not path.is_dir():
        raise ModelLoadError(f"checkpoint directory {path} does not exist")
    for adapter, directory in settings.lora_modules.items():
        if not directory.is_dir():
            raise ModelLoadError(f"--lora {adapter}: no adapter directory {directory}")
    for root in settings.lora_roots:
        if not Path(root).is_dir():
            raise ModelLoadError(f"--lora-root: no directory {root}")
    _, dtype = check_load(
        settings.device, settings.dtype, settings.quantize, settings.batch_invariant,
        settings.int8_activations,
    )  # fmt: skip
    try:
        cache_dtype(dtype, DTYPES.get(settings.kv_cache_dtype))
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from None


def load_model(settings: Settings) -> LoadedModel:
    """Load the checkpoint (engine.loader), then its chat template; raises ModelLoadError."""
    preflight(settings)
    try:
        path = resolve_model(settings.model, warn=log.warning, progress=log.info)
    except FetchError as exc:
        raise ModelLoadError(str(exc)) from None
    loaded = load_for_inference(
        path, device=settings.device, dtype=settings.dtype,
        quantization=settings.quantize, draft_path=settings.draft_model,
        batch_invariant=settings.batch_invariant, int8_activations=settings.int8_activations,
    )  # fmt: skip
    try:
        override = Path(settings.chat_template) if settings.chat_template else None
        template = load_chat_format(loaded.path, loaded.tokenizer, override)
    except (ValueError, RuntimeError, OSError) as exc:
        raise ModelLoadError(str(exc).splitlines()[0] if str(exc) else repr(exc)) from None
    known = settings.model_name
    fell_back = known is not None and known != "shakespeare" and path == SHAKESPEARE_DIR
    name = settings.served_model_name or ("shakespeare" if fell_back else known) or loaded.name
    served = LoadedModel(loaded.model, loaded.tokenizer, name, template, loaded.path, loaded.draft)
    if settings.serves_lora:
        cpu = loaded.device.type == "cpu"
        add_lora_slots(served, settings, torch.float32 if cpu else loaded.dtype)
    return served


def add_lora_slots(loaded: LoadedModel, settings: Settings, auto_dtype: torch.dtype) -> None:
    """Give the loaded (optimized) model its LoRA slots and read --lora's adapters into
    `loaded`, each checked against the slots (rank, shapes); raises ModelLoadError.
    `auto_dtype`: the adapters' dtype for --lora-dtype auto."""
    dtype = DTYPES.get(settings.lora_dtype, auto_dtype)
    loaded.lora = install_lora(loaded.model, settings.max_loras, settings.max_lora_rank, dtype)
    for name, directory in settings.lora_modules.items():
        if name == loaded.name:
            raise ModelLoadError(f"--lora {name}: the served model already has that name")
        try:
            adapter = read_adapter(directory, loaded.model.config, name)
            loaded.lora.check(adapter)
        except (AdapterError, LoraRankError, LoraShapeError) as exc:
            raise ModelLoadError(f"--lora {name}: {exc}") from None
        loaded.adapters[name] = (adapter, directory)


def default_kv_tokens(settings: Settings, loaded: LoadedModel) -> int:
    """The KV pool's tokens without --kv-cache-gb: sized from the model's context."""
    context = loaded.model.config.context_length
    return max(DEFAULT_KV_CONTEXTS * context, settings.max_num_seqs * DEFAULT_KV_TOKENS_PER_SEQ)


class ServerState:
    """Readiness and the engine of one app; the app's handlers reach everything through it.

    `loader` turns the settings into a loaded model (tests pass a slow one); `on_load_error` is
    called with the message when loading fails (`gptserve serve` then exits), and
    `on_engine_failure` with the reason when the engine turns unhealthy or dies (with
    --exit-on-engine-failure `gptserve serve` exits then too).
    """

    def __init__(
        self,
        settings: Settings,
        metrics: Metrics,
        loader: Callable[[Settings], LoadedModel] = load_model,
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.loader = loader
        self.on_load_error: Callable[[str], None] | None = None
        self.on_engine_failure: Callable[[str], None] | None = None
        self.loaded: LoadedModel | None = None
        self.async_engine: AsyncEngine | None = None
        self.validator: Validator | None = None
        # the LoRA adapters requests may name, as the engine has them loaded (server.lora_api)
        self.lora_names: dict[str, str] = {}  # name -> where it was read from
        # the fine-tuned models (server.fine_tuning): name -> the tenant that may use it
        self.model_owners: dict[str, str | None] = {}
        self.load_error: str | None = None
        self.loader_thread: threading.Thread | None = None
        self.load_seconds: float | None = None  # the model's load (fetch included)
        self._engine_started = 0.0
        self.closed = False
        self._lock = threading.Lock()  # closed vs. a start finishing in the loader thread

    def start_loading(self) -> threading.Thread:
        """Load the model and start the engine in a thread of their own; returns the thread.

        The loader thread ends once the engine runs, and with it the OpenMP pool its torch work
        made: a pool left in a thread that lives on (the event loop's) would slow the engine
        thread down (see engine.async_engine).
        """
        thread = threading.Thread(target=self._load_and_start, name="model-loader", daemon=True)
        self.loader_thread = thread
        thread.start()
        return thread

    def _load_and_start(self) -> None:
        try:
            started = time.perf_counter()
            loaded = self.loader(self.settings)
            self.load_seconds = time.perf_counter() - started
            self._start(loaded)
        except Exception as exc:  # readiness reports it; the process keeps answering /health
            self.load_error = str(exc) or repr(exc)
            log.error("model failed to load: %s", self.load_error)
            if self.on_load_error is not None:
                self.on_load_error(self.load_error)

    def _start(self, loaded: LoadedModel) -> None:
        """Build the engine around a loaded model and start its thread."""
        if self.closed:  # shut down while the model was loading
            return
        self._engine_started = time.perf_counter()
        settings = self.settings
        config = EngineConfig(
            max_num_seqs=settings.max_num_seqs,
            max_batch_tokens=settings.max_batch_tokens,
            tenant_step_tokens=settings.tenant_step_tokens,
            kv_block_size=settings.block_size,
            kv_cache_bytes=int((settings.kv_cache_gb or 2.0) * (1 << 30)),
            kv_cache_tokens=None if settings.kv_cache_gb else default_kv_tokens(settings, loaded),
            prefix_caching=not settings.no_prefix_cache,
            speculative="draft" if settings.draft_model else settings.speculative,
            num_speculative_tokens=settings.num_speculative_tokens,
            batch_invariant=settings.batch_invariant,
            kv_cache_dtype=DTYPES.get(settings.kv_cache_dtype),  # auto: None, the model's
        )

        remembered = self._remembered_adapters(loaded)

        def build() -> Engine:
            engine = Engine(loaded.model, loaded.tokenizer, config, loaded.draft, loaded.lora)
            for name, (adapter, _) in loaded.adapters.items():
                engine.adapters.load(name, adapter)
            for name, adapter in remembered.items():
                engine.adapters.load(name, adapter)
            return engine

        async_engine = AsyncEngine(
            build, max_consecutive_failed_steps=settings.max_consecutive_failed_steps
        )
        async_engine.on_failure = self._engine_failed
        async_engine.start()  # the Engine is built in the engine thread (see engine.async_engine)
        limits = async_engine.limits
        embedding = EmbeddingSpec.read(loaded.path, loaded.model.config.n_embd, settings.pooling)
        validator = Validator(
            settings, limits, loaded.name, loaded.tokenizer, loaded.template, embedding,
            self.lora_names,
        )  # fmt: skip
        with self._lock:
            closed = self.closed  # shut down while the engine was being built?
            if not closed:
                self.lora_names.update({n: str(d) for n, (_, d) in loaded.adapters.items()})
                self.metrics.watch(async_engine)
                self.loaded, self.validator, self.async_engine = loaded, validator, async_engine
        if closed:
            async_engine.stop()
            return
        release_freed_memory()  # what loading and building the engine freed goes back
        kv_tokens = limits.kv_cache_blocks * limits.kv_block_size
        age = process_seconds()
        if age is not None and self.load_seconds is not None:
            log.info(
                "ready %.1f s after start: the model loaded in %.1f s, the engine built in %.1f s",
                age, self.load_seconds, time.perf_counter() - self._engine_started,
            )  # fmt: skip
        log.info(
            "serving %s from %s (context %d tokens; the KV cache holds %d tokens, %.0f MB at "
            "most: %d blocks of %d tokens, %d bytes a token)",
            loaded.name, loaded.path, limits.max_model_len, kv_tokens,
            kv_tokens * async_engine.kv_bytes_per_token / 1e6, limits.kv_cache_blocks,
            limits.kv_block_size, async_engine.kv_bytes_per_token,
        )  # fmt: skip

    def _remembered_adapters(self, loaded: LoadedModel) -> dict[str, LoraAdapter]:
        """The adapters this model served before it was unloaded (loaded at run time or
        fine-tuned; `lora_names` keeps them), read again for its new engine; one that no longer
        reads is dropped with a warning."""
        adapters = {}
        for name, source in list(self.lora_names.items()):
            if name in loaded.adapters or loaded.lora is None:
                continue
            try:
                adapter = read_adapter(Path(source), loaded.model.config, name)
                loaded.lora.check(adapter)
            except (AdapterError, LoraRankError, LoraShapeError, OSError) as exc:
                log.warning("%s: the adapter %s is no longer served: %s", loaded.name, name, exc)
                self.lora_names.pop(name, None)
                continue
            adapters[name] = adapter
        return adapters

    def stop(self) -> None:
        with self._lock:
            self.closed = True
            async_engine = self.async_engine
        if async_engine is not None:
            async_engine.stop()

    def unload(self) -> None:
        """Stop the engine and let the model go, so the process's memory falls back; the state
        can load again (`start_loading`). Its adapters' names and fine-tuned models' owners
        stay: they come back with the model. Blocking (the engine thread is joined)."""
        with self._lock:
            async_engine = self.async_engine
            self.loaded, self.validator, self.async_engine = None, None, None
            self.load_error, self.loader_thread = None, None
        self.metrics.unwatch()
        if async_engine is not None:
            async_engine.stop()
            async_engine.on_failure = None
        del async_engine
        gc.collect()  # the model's tensors sit in reference cycles (modules, closures)
        release_freed_memory()

    @property
    def busy(self) -> bool:
        """Whether the engine has running or queued sequences."""
        async_engine = self.async_engine
        return async_engine is not None and async_engine.num_running + async_engine.num_waiting > 0

    def resident_bytes(self) -> int:
        """The loaded model's weights (draft included) and its KV pool at its full size: what
        --max-loaded-gb counts; 0 when nothing is loaded."""
        loaded, async_engine = self.loaded, self.async_engine
        if loaded is None or async_engine is None:
            return 0
        size = 0
        for model in (loaded.model, loaded.draft):
            if model is not None:
                size += sum(t.numel() * t.element_size() for t in model.parameters())
                size += sum(t.numel() * t.element_size() for t in model.buffers())
        limits = async_engine.limits
        kv = limits.kv_cache_blocks * limits.kv_block_size * async_engine.kv_bytes_per_token
        return size + kv

    def _engine_failed(self, reason: str) -> None:  # called in the engine thread
        if self.on_engine_failure is not None:
            self.on_engine_failure(reason)

    @property
    def engine_failure(self) -> str | None:
        """Why the engine stopped serving (unhealthy or dead), or None while it serves."""
        async_engine = self.async_engine
        return None if async_engine is None else async_engine.dead or async_engine.unhealthy

    @property
    def ready(self) -> bool:
        return self.async_engine is not None and not self.async_engine.dead

    def require_ready(self) -> AsyncEngine:
        """The engine, or a 503 that says why it cannot serve."""
        if self.async_engine is None:
            if self.load_error:  # with keys, the reason (it may name paths) stays in the log
                reason = "the server log has the reason" if self.settings.auth_keys else None
                raise APIError(
                    503, f"the model failed to load: {reason or self.load_error}",
                    code="model_load_failed",
                )  # fmt: skip
            raise APIError(
                503, "the model is still loading", code="loading", headers={"Retry-After": "1"}
            )
        if self.async_engine.dead:
            raise APIError(
                503, f"the engine has stopped: {self.async_engine.dead}", code="engine_dead"
            )
        if self.async_engine.unhealthy:
            raise _unhealthy(self.async_engine.unhealthy)
        return self.async_engine

    def may_use(self, model: str | None, tenant: str | None) -> bool:
        """Whether `tenant` may see and use `model` (only a fine-tuned model has an owner)."""
        return model not in self.model_owners or self.model_owners[model] == tenant

    def check_owner(self, model: str | None, tenant: str | None) -> None:
        """A 404, as for an unknown model, for another tenant's fine-tuned model."""
        if not self.may_use(model, tenant):
            raise APIError(
                404, f"the model {model!r} does not exist", param="model", code="model_not_found"
            )

    def health(self) -> tuple[int, dict]:
        async_engine = self.async_engine
        if async_engine is None:
            if self.load_error:  # /health needs no key: the reason (paths) is in the log
                return 503, {"status": "failed", "error": "the model failed to load"}
            return 503, {"status": "loading"}
        body = {
            "status": "ok",
            "model": self.loaded.name,
            "failed_steps": async_engine.num_failed_steps,
            "running": async_engine.num_running,
            "waiting": async_engine.num_waiting,
        }
        if async_engine.dead:
            return 503, {**body, "status": "dead", "error": async_engine.dead}
        if async_engine.unhealthy:  # the body is also an OpenAI error: what every request now gets
            return 503, {**body, "status": "unhealthy", **_unhealthy(async_engine.unhealthy).body()}
        return 200, body


def process_seconds() -> float | None:
    """Seconds since this process started (Linux's /proc; None elsewhere), for the startup log."""
    try:
        with open("/proc/self/stat") as f:
            started_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return uptime - started_ticks / os.sysconf("SC_CLK_TCK")


def _unhealthy(reason: str) -> APIError:
    return APIError(503, f"the engine is unhealthy: {reason}", code="engine_unhealthy")
