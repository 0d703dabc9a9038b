"""POST /v1/embeddings: each input's vector, pooled by the engine from the model's final hidden
states (engine.pooling), as OpenAI and vLLM answer it."""

from __future__ import annotations

import base64
import struct
import time
import uuid
from contextlib import aclosing

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from gptserve.engine.async_engine import EngineDeadError
from gptserve.engine.sequence import SEQUENCE_ERROR
from gptserve.server.errors import APIError
from gptserve.server.models.routing import request_model
from gptserve.server.openai_api import check_queue, engine_stopped
from gptserve.server.protocol import ERROR_RESPONSES, EmbeddingRequest, EmbeddingResponse
from gptserve.server.request_log import RequestLog
from gptserve.server.streams import ClientGone, RequestTimeout, merged_events
from gptserve.server.tenancy import TENANT_SCOPE_KEY
from starlette.concurrency import run_in_threadpool

router = APIRouter()
ENDPOINT = "embeddings"  # the endpoint label of gptserve_requests


def encode_base64(vector: list[float]) -> str:
    """OpenAI's base64 form: the vector's little-endian float32 bytes."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


@router.post("/v1/embeddings", response_model=EmbeddingResponse, responses=ERROR_RESPONSES)
async def create_embeddings(body: EmbeddingRequest, request: Request) -> Response:
    state = await request_model(request, body.model)
    async_engine = state.require_ready()
    inputs = await run_in_threadpool(state.validator.embedding, body)  # tokenizing: off the loop
    tenant = request.scope.get(TENANT_SCOPE_KEY)
    state.check_owner(inputs.params.lora, tenant)  # another key's fine-tuned model: 404
    check_queue(state, async_engine, tenant)
    inputs.params.tenant = tenant  # admitted in turn with other keys' (engine.scheduler)
    prompts = inputs.prompts
    num_tokens = sum(len(p) for p in prompts)
    state.metrics.prompt_tokens.inc(num_tokens)
    vectors: list[list[float] | None] = [None] * len(prompts)
    status: int | str = 200
    engine_id, model = f"embd-{uuid.uuid4().hex}", inputs.params.lora or state.loaded.name
    account = RequestLog.begin(request, ENDPOINT, engine_id, model, num_tokens, time.perf_counter())
    scheduled: list[float] = []  # when the engine first ran each input
    try:
        events = merged_events(
            async_engine, engine_id, prompts, inputs.params, state.settings.request_timeout,
            watch=request,
        )  # fmt: skip
        async with aclosing(events) as stream:  # leaving early aborts what still runs
            async for index, event in stream:
                if event.scheduled_at is not None:
                    scheduled.append(event.scheduled_at)
                if event.error is not None:
                    own = event.error_code == SEQUENCE_ERROR
                    who = "this request" if own else "the engine"
                    code = SEQUENCE_ERROR if own else "engine_error"
                    raise APIError(503, f"{who} failed: {event.error}", code=code)
                if event.embedding is not None:
                    vectors[index] = event.embedding
    except RequestTimeout:
        status = 503
        raise APIError(
            503, "the request ran past the server's --request-timeout", code="request_timeout"
        ) from None
    except EngineDeadError as exc:
        status = 503
        raise engine_stopped(exc) from None
    except ClientGone:
        status = "disconnected"
        raise
    except APIError as exc:
        status = exc.status
        raise
    finally:
        state.metrics.count_request(ENDPOINT, status, None)
        account.finish(status, scheduled_at=min(scheduled, default=None))
    data = [
        {
            "object": "embedding",
            "index": i,
            "embedding": encode_base64(v) if inputs.base64 else v,
        }
        for i, v in enumerate(vectors)
    ]
    usage = {"prompt_tokens": num_tokens, "total_tokens": num_tokens}
    return JSONResponse(
        {
            "object": "list",
            "data": data,
            "model": model,
            "usage": usage,
        }
    )
