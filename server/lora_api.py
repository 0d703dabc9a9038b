"""vLLM's runtime LoRA endpoints: `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`.

Off unless the server runs with --enable-lora-loading (then 404, as vLLM answers without its
VLLM_ALLOW_RUNTIME_LORA_UPDATING). On a server with API keys only an admin key may call them
(server.admin; others get 403 `permission_denied`). A `lora_path` must resolve, symlinks
followed, inside one of the --lora-root directories; whatever is not an adapter there (missing,
outside every root, a file, unreadable, not PEFT's) gets the one 400 `lora_path_invalid`, which
does not tell whether the path exists. Loading reads the PEFT directory off the event loop, then
puts the adapter in a free slot on the engine thread, between steps; it answers 200 with a line
of text, as vLLM does, or an OpenAI-shaped error: 400 for a bad path, a rank above
--max-lora-rank, an adapter that does not fit the base, a name taken, or no free slot; 404 for
unloading an adapter that is not loaded. An adapter unloaded while requests use it is no longer
named (new requests get 404) but its requests finish with it (`engine.adapters`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from fastapi import APIRouter, Depends, Request
from fastapi.responses import PlainTextResponse
from gptserve.engine.adapters import BAD_PATH, NOT_FOUND, AdapterError, read_adapter
from gptserve.engine.async_engine import EngineDeadError
from gptserve.model.config import ModelConfig
from gptserve.model.lora.adapter import LoraAdapter
from gptserve.server.admin import require_admin
from gptserve.server.errors import APIError
from gptserve.server.models.routing import request_model
from gptserve.server.openai_api import engine_stopped
from gptserve.server.protocol import (
    PLAIN_TEXT_ERRORS,
    LoadLoraAdapterRequest,
    UnloadLoraAdapterRequest,
)
from gptserve.server.runtime import ServerState
from starlette.concurrency import run_in_threadpool

log = logging.getLogger(__name__)
router = APIRouter()
# what a lora_path that is no adapter under a root gets, whatever the reason: it must not tell an
# existing directory from a missing one, nor a file outside the roots from one inside
NO_ADAPTER = "lora_path: no adapter by that name under the server's LoRA roots (--lora-root)"


async def _loading_on(request: Request) -> None:
    """404 unless the server runs with --enable-lora-loading (checked before the admin scope)."""
    if not request.app.state.server.settings.enable_lora_loading:
        raise APIError(
            404, "loading LoRA adapters at run time is off (start the server with "
            "--enable-lora-loading)", code="not_found",
        )  # fmt: skip


# the endpoints' checks, in order: on at all, then the caller's scope, then the body
_GUARDS = [Depends(_loading_on), Depends(require_admin)]


def read_rooted_adapter(path: str, roots: list[str], config: ModelConfig, name: str) -> LoraAdapter:
    """The adapter at `path` for a base of `config` when `path` resolves (symlinks followed)
    inside one of `roots`; raises AdapterError, with the one NO_ADAPTER message for any path that
    is not an adapter there (the reason goes to the log)."""
    if not roots:
        raise AdapterError(
            "lora_path: this server loads no adapter from a path (it has no --lora-root)",
            "lora_path", BAD_PATH,
        )  # fmt: skip
    try:
        directory = Path(path).resolve()
        inside = any(directory.is_relative_to(Path(root).resolve()) for root in roots)
    except (OSError, RuntimeError, ValueError):  # a symlink loop, a NUL byte, ...
        inside = False
    if not inside:
        log.info("load_lora_adapter %r: %r is outside every --lora-root", name, path)
        raise AdapterError(NO_ADAPTER, "lora_path", BAD_PATH)
    try:
        return read_adapter(directory, config, name)
    except AdapterError as exc:
        if exc.code != BAD_PATH:  # an adapter, of another base: say so, without the path
            message = exc.message.replace(str(directory), repr(path))
            raise AdapterError(message, exc.param, exc.code) from None
        log.info("load_lora_adapter %r: %s", name, exc.message)
        raise AdapterError(NO_ADAPTER, "lora_path", BAD_PATH) from None


@contextmanager
def _adapter_errors(late: str) -> Iterator[None]:
    """The endpoints' errors in the OpenAI shape: an AdapterError (404 for an unknown adapter,
    else 400), a dead engine (503), and the engine not done in time (503 with `late`)."""
    try:
        yield
    except AdapterError as exc:
        status = 404 if exc.code == NOT_FOUND else 400
        raise APIError(status, exc.message, param=exc.param, code=exc.code) from None
    except EngineDeadError as exc:
        raise engine_stopped(exc) from None
    except asyncio.TimeoutError:
        raise APIError(503, late, code="timeout") from None


@router.post(
    "/v1/load_lora_adapter", response_class=PlainTextResponse, responses=PLAIN_TEXT_ERRORS,
    dependencies=_GUARDS,
)  # fmt: skip
async def load_lora_adapter(body: LoadLoraAdapterRequest, request: Request) -> PlainTextResponse:
    state = await request_model(request, body.base_model)  # the base: the default by default
    async_engine = state.require_ready()
    name = body.lora_name
    if name == state.loaded.name:
        raise APIError(
            400, f"{name!r} is the base model's name", param="lora_name", code="lora_name_taken"
        )
    _check_name_free(request, state, name)
    config = state.loaded.model.config
    with _adapter_errors("the engine did not take the adapter in time"):
        roots = state.settings.lora_roots
        adapter = await run_in_threadpool(read_rooted_adapter, body.lora_path, roots, config, name)
        await async_engine.run_on_engine(lambda engine: engine.adapters.load(name, adapter))
    state.lora_names[name] = body.lora_path
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post(
    "/v1/unload_lora_adapter", response_class=PlainTextResponse, responses=PLAIN_TEXT_ERRORS,
    dependencies=_GUARDS,
)  # fmt: skip
async def unload_lora_adapter(
    body: UnloadLoraAdapterRequest, request: Request
) -> PlainTextResponse:
    name = body.lora_name
    state = _base_of(request, name)
    if state.async_engine is None and name in state.lora_names:  # its base is not loaded now
        state.lora_names.pop(name, None)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
    if state.async_engine is None:
        state = await request_model(request, None)
    async_engine = state.require_ready()
    state.lora_names.pop(name, None)  # new requests for it are refused from now on
    with _adapter_errors("the engine did not unload in time"):
        await async_engine.run_on_engine(lambda engine: engine.adapters.unload(name))
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


def _base_of(request: Request, name: str) -> ServerState:
    """The model whose adapter `name` is (on a server of several), else the default model."""
    models = request.app.state.models
    for spec in models.specs():
        state = models.state(spec.name or None)
        if name in state.lora_names:
            return state
    return models.state(None)


def _check_name_free(request: Request, base: ServerState, name: str) -> None:
    """An adapter's name is one base's: 400 when another model or another base's adapter has
    it (a request naming it must reach one base)."""
    models = request.app.state.models
    if not models.many:
        return
    taken = name in models.names() or any(
        name in models.state(n).lora_names for n in models.names() if models.state(n) is not base
    )
    if taken:
        raise APIError(
            400, f"{name!r} is already the name of another model or of another model's adapter",
            param="lora_name", code="lora_name_taken",
        )  # fmt: skip
