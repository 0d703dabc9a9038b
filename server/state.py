"""What a running server holds: the loaded model, the engine and its thread, and readiness."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from model import GPT, Tokenizer, get_tokenizer, load_checkpoint
from model.cpu import optimize_for_cpu
from server.async_engine import AsyncEngine
from server.chat import ChatTemplate
from server.engine import Engine, EngineConfig
from server.errors import APIError
from server.metrics import Metrics
from server.settings import DEFAULT_MODEL_DIR, Settings

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class ModelLoadError(RuntimeError):
    """The checkpoint cannot be served; the message is one line for the user."""


@dataclass
class LoadedModel:
    model: GPT
    tokenizer: Tokenizer
    name: str
    template: ChatTemplate
    path: Path


def resolve_device(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("--device cuda was asked for but CUDA is not available")
    if dtype == "auto":
        return torch.device(device), torch.bfloat16 if device == "cuda" else torch.float32
    return torch.device(device), _DTYPES[dtype]


def load_model_in_thread(settings: Settings) -> LoadedModel:
    """`load_model` in a short-lived thread, so the caller's thread never runs parallel torch work.

    A finished thread's OpenMP pool is freed; one left in the main thread would slow the engine
    thread down (see server.async_engine).
    """
    result: list[LoadedModel] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            result.append(load_model(settings))
        except BaseException as exc:
            error.append(exc)

    thread = threading.Thread(target=target, name="model-loader", daemon=True)  # Ctrl-C exits
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


def load_model(settings: Settings) -> LoadedModel:
    """Load the checkpoint, its tokenizer and chat template; raises ModelLoadError."""
    path = settings.model_path
    if not path.is_dir():
        if settings.model is None:
            raise ModelLoadError(
                f"no --model given and the bundled default model is missing at {DEFAULT_MODEL_DIR}"
            )
        raise ModelLoadError(f"checkpoint directory {path} does not exist")
    device, dtype = resolve_device(settings.device, settings.dtype)
    try:
        model = optimize_for_cpu(load_checkpoint(path, device=device, dtype=dtype))
        tokenizer = get_tokenizer(model.config.tokenizer)
        template = ChatTemplate.for_checkpoint(path)
    except (ValueError, RuntimeError, OSError) as exc:
        raise ModelLoadError(str(exc).splitlines()[0] if str(exc) else repr(exc)) from None
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ModelLoadError(
            f"the model's vocab_size {model.config.vocab_size} is smaller than the tokenizer's "
            f"{tokenizer.vocab_size}"
        )
    name = settings.served_model_name or path.resolve().name
    return LoadedModel(model, tokenizer, name, template, path)


class ServerState:
    """Readiness and the engine of one app; the app's handlers reach everything through it."""

    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.loaded: LoadedModel | None = None
        self.engine: Engine | None = None
        self.aeng: AsyncEngine | None = None
        self.load_error: str | None = None
        self.closed = False
        self._lock = threading.Lock()  # closed vs. a start() finishing in another thread

    def start(self, loaded: LoadedModel) -> None:
        """Build the engine around a loaded model and start its thread."""
        if self.closed:  # shut down while the model was loading
            return
        s = self.settings
        config = EngineConfig(
            max_num_seqs=s.max_num_seqs,
            max_batch_tokens=s.max_batch_tokens,
            block_size=s.block_size,
            kv_cache_bytes=int(s.kv_cache_gb * (1 << 30)),
        )
        aeng = AsyncEngine(lambda: Engine(loaded.model, loaded.tokenizer, config))
        aeng.on_step = self.metrics.on_step
        engine = aeng.start()  # built in the engine thread (see server.async_engine)
        with self._lock:
            closed = self.closed  # shut down while the engine was being built?
            if not closed:
                self.loaded, self.engine, self.aeng = loaded, engine, aeng
        if closed:
            aeng.stop()
            return
        self.metrics.watch_engine(
            running=lambda: engine.num_running,
            waiting=lambda: aeng.num_waiting,
            kv_usage=lambda: engine.kv_usage,
            failed_steps=lambda: engine.num_failed_steps,
        )
        log.info(
            "serving %s from %s on %s (%d KV blocks of %d tokens)",
            loaded.name, loaded.path, engine.device, engine.cache.num_blocks, config.block_size,
        )  # fmt: skip

    def load_and_start(self) -> None:
        """For apps built without a preloaded model: runs in a thread during startup."""
        try:
            self.start(load_model(self.settings))
        except Exception as exc:  # readiness reports it; the process keeps answering /health
            self.load_error = str(exc) or repr(exc)
            log.error("model failed to load: %s", self.load_error)

    def stop(self) -> None:
        with self._lock:
            self.closed = True
            aeng = self.aeng
        if aeng is not None:
            aeng.stop()

    @property
    def ready(self) -> bool:
        return self.aeng is not None and not self.aeng.dead

    def require_ready(self) -> AsyncEngine:
        """The engine, or a 503 that says why it cannot serve."""
        if self.aeng is None:
            if self.load_error:
                raise APIError(
                    503, f"the model failed to load: {self.load_error}", code="model_load_failed"
                )
            raise APIError(
                503, "the model is still loading", code="loading", headers={"Retry-After": "1"}
            )
        if self.aeng.dead:
            raise APIError(503, f"the engine has stopped: {self.aeng.dead}", code="engine_dead")
        return self.aeng

    def health(self) -> tuple[int, dict]:
        if self.aeng is None or self.engine is None:
            if self.load_error:
                return 503, {"status": "failed", "error": self.load_error}
            return 503, {"status": "loading"}
        body = {
            "status": "ok",
            "model": self.loaded.name if self.loaded else None,
            "failed_steps": self.engine.num_failed_steps,
            "running": self.engine.num_running,
            "waiting": self.aeng.num_waiting,
        }
        if self.aeng.dead:
            return 503, {**body, "status": "dead", "error": self.aeng.dead}
        return 200, body
