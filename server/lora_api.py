"""vLLM's runtime LoRA endpoints: `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`.

Off unless the server runs with --enable-lora-loading (then 404, as vLLM answers without its
VLLM_ALLOW_RUNTIME_LORA_UPDATING). Loading reads the PEFT directory off the event loop, then
puts the adapter in a free slot on the engine thread, between steps; it answers 200 with a line
of text, as vLLM does, or an OpenAI-shaped error: 400 for a bad path, a rank above
--max-lora-rank, an adapter that does not fit the base, a name taken, or no free slot; 404 for
unloading an adapter that is not loaded. An adapter unloaded while requests use it is no longer
named (new requests get 404) but its requests finish with it (`engine.adapters`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from gptserve.engine.adapters import NOT_FOUND, AdapterError, read_adapter
from gptserve.engine.async_engine import EngineDeadError
from gptserve.server.errors import APIError
from gptserve.server.openai_api import engine_stopped
from gptserve.server.protocol import (
    ERROR_RESPONSES,
    LoadLoraAdapterRequest,
    UnloadLoraAdapterRequest,
)
from gptserve.server.runtime import ServerState
from starlette.concurrency import run_in_threadpool

router = APIRouter()


def _state(request: Request) -> ServerState:
    state: ServerState = request.app.state.server
    if not state.settings.enable_lora_loading:
        raise APIError(
            404, "loading LoRA adapters at run time is off (start the server with "
            "--enable-lora-loading)", code="not_found",
        )  # fmt: skip
    return state


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


@router.post("/v1/load_lora_adapter", response_class=PlainTextResponse, responses=ERROR_RESPONSES)
async def load_lora_adapter(body: LoadLoraAdapterRequest, request: Request) -> PlainTextResponse:
    state = _state(request)
    async_engine = state.require_ready()
    name = body.lora_name
    if name == state.loaded.name:
        raise APIError(
            400, f"{name!r} is the base model's name", param="lora_name", code="lora_name_taken"
        )
    config = state.loaded.model.config
    with _adapter_errors("the engine did not take the adapter in time"):
        adapter = await run_in_threadpool(read_adapter, body.lora_path, config, name)
        await async_engine.run_on_engine(lambda engine: engine.adapters.load(name, adapter))
    state.lora_names[name] = body.lora_path
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse, responses=ERROR_RESPONSES)
async def unload_lora_adapter(
    body: UnloadLoraAdapterRequest, request: Request
) -> PlainTextResponse:
    state = _state(request)
    async_engine = state.require_ready()
    name = body.lora_name
    state.lora_names.pop(name, None)  # new requests for it are refused from now on
    with _adapter_errors("the engine did not unload in time"):
        await async_engine.run_on_engine(lambda engine: engine.adapters.unload(name))
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
