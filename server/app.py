"""The FastAPI application: `create_app(settings)` builds one; `gptserve serve` runs one.

Besides the OpenAI routes (server.openai_api, server.embeddings_api, server.responses.api) it
serves /health, /metrics, /v1/models, /tokenize, /detokenize and the playground (server/static)
at /. A plain ASGI gate in front of everything enforces the concurrency cap, API keys and the
body-size limit before any body is parsed.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from gptserve.server.admin import ADMIN_SCOPE_KEY, is_admin, warn_about_admin_scope
from gptserve.server.embeddings_api import router as embeddings_router
from gptserve.server.errors import APIError, bad_request, install_error_handlers
from gptserve.server.fine_tuning.files_api import router as files_router
from gptserve.server.fine_tuning.jobs_api import router as fine_tuning_router
from gptserve.server.fine_tuning.manager import FineTuning
from gptserve.server.hosts import host_allowed
from gptserve.server.lora_api import router as lora_router
from gptserve.server.messages.api import router as messages_router
from gptserve.server.messages.errors import AnthropicErrorShape
from gptserve.server.metrics import Metrics
from gptserve.server.models.registry import ModelLeases, ModelRegistry
from gptserve.server.ollama.api import router as ollama_router
from gptserve.server.ollama.errors import OllamaErrorShape
from gptserve.server.openai_api import router as openai_router
from gptserve.server.protocol import (
    ERROR_RESPONSES,
    DetokenizeRequest,
    DetokenizeResponse,
    HealthResponse,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from gptserve.server.request_ids import install as install_request_ids
from gptserve.server.responses.api import router as responses_router
from gptserve.server.responses.store import ResponseStore
from gptserve.server.runtime import LoadedModel, load_model
from gptserve.server.settings import Settings
from gptserve.server.streams import ClientGone
from gptserve.server.tenancy import TENANT_SCOPE_KEY, key_tenant
from gptserve.server.tracing import start_tracing
from starlette.types import ASGIApp, Message, Receive, Scope, Send

STATIC_DIR = Path(__file__).resolve().parent / "static"
_AUTH_PREFIXES = ("/v1/", "/tokenize", "/detokenize", "/api/")
_OPEN_PATHS = ("/api/version",)  # open as /health is (Ollama's clients probe it)
_UNCOUNTED_PATHS = ("/health", "/metrics")
_MULTIPART_OVERHEAD = 1 << 16  # an upload's form fields and boundaries besides the file


class AdmissionControl:
    """ASGI middleware: concurrency cap, Bearer auth on the API paths, and the body-size limit.

    An authenticated request carries its key's tenant (TENANT_SCOPE_KEY, server.tenancy) and
    whether the key is an admin's (ADMIN_SCOPE_KEY, server.admin) in its scope, not the key.

    The body is read here (at most max_body_bytes) and replayed to the app, so an oversized body
    is refused with 413 whether or not it declared its Content-Length.
    """

    def __init__(self, app: ASGIApp, settings: Settings, metrics: Metrics) -> None:
        self.app = app
        self.settings = settings
        self.metrics = metrics
        admin = set(settings.admin_api_keys)
        # (key, its tenant, whether it is an admin key)
        self.keys = [(k.encode(), key_tenant(k.encode()), k in admin) for k in settings.auth_keys]
        self.active = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        capped = scope["path"] not in _UNCOUNTED_PATHS  # probes answer even at the cap
        if capped and self.active >= self.settings.max_concurrent_requests:
            err = APIError(
                429,
                f"too many concurrent requests (at most {self.settings.max_concurrent_requests}); "
                "retry later",
                code="too_many_requests",
                headers={"Retry-After": "1"},
            )
            await err.response()(scope, receive, send)
            return
        self.active += capped

        async def counted_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.responses.labels(str(message["status"])).inc()
            await send(message)

        try:
            await self._handle(scope, receive, counted_send)
        finally:
            self.active -= capped

    async def _handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        path: str = scope["path"]
        host = dict(scope["headers"]).get(b"host")
        settings = self.settings
        if not host_allowed(host and host.decode("latin-1"), settings.host, settings.allowed_hosts):
            err = APIError(
                403,
                "this server is bound to a loopback address and answers only loopback host "
                "names (a guard against DNS rebinding); start it with --allowed-host NAME to "
                "answer another",
                code="host_not_allowed",
            )
            await err.response()(scope, receive, send)
            return
        if not self.keys:
            scope[ADMIN_SCOPE_KEY] = True  # an open server: everyone may act as an admin
        elif path.startswith(_AUTH_PREFIXES) and path not in _OPEN_PATHS:
            tenant, admin = self._tenant(scope)
            if tenant is None:
                err = APIError(
                    401,
                    "missing or invalid API key (send 'Authorization: Bearer KEY' or "
                    "'x-api-key: KEY')",
                    code="invalid_api_key",
                )
                await err.response()(scope, receive, send)
                return
            scope[TENANT_SCOPE_KEY] = tenant  # whose prefix cache it shares (server.tenancy)
            scope[ADMIN_SCOPE_KEY] = admin  # whether it may act as an admin (server.admin)
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        limit = self.settings.max_body_bytes
        if path == "/v1/files" and settings.enable_fine_tuning:  # an upload: --max-file-bytes
            limit = max(limit, settings.max_file_bytes + _MULTIPART_OVERHEAD)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                await bad_request("invalid Content-Length header").response()(scope, receive, send)
                return
            if int(declared) > limit:
                await _too_large(limit).response()(scope, receive, send)
                return
        try:
            body = await asyncio.wait_for(_read_body(receive, limit), self.settings.body_timeout)
        except asyncio.TimeoutError:  # a client that stalls mid-body must not hold a slot for ever
            seconds = f"{self.settings.body_timeout:g}"
            err = APIError(
                408,
                f"the request body did not arrive within {seconds} seconds",
                code="body_timeout",
            )
            await err.response()(scope, receive, send)
            return
        if body is None:  # the client left
            return
        if len(body) > limit:
            await _too_large(limit).response()(scope, receive, send)
            return
        await self.app(scope, _replay(body, receive), send)

    def _tenant(self, scope: Scope) -> tuple[str | None, bool]:
        """The tenant of the request's Bearer key, else of its `x-api-key` header (Anthropic's;
        None when it has no configured key), and whether the key is an admin key."""
        headers = dict(scope["headers"])
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        if scheme.lower() == b"bearer":
            token = token.strip()
        elif b"x-api-key" in headers:
            token = headers[b"x-api-key"].strip()
        else:
            return None, False
        found, admin = None, False
        for key, tenant, is_admin_key in self.keys:  # every key compared, in constant time
            if hmac.compare_digest(token, key):
                found, admin = tenant, admin or is_admin_key
        return found, admin


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    """The whole body; None if the client disconnected; stops reading once past `limit` bytes."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        chunks.append(chunk)
        if size > limit or not message.get("more_body", False):
            return b"".join(chunks)


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than {limit} bytes", code="request_too_large")


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # after the body: only http.disconnect

    return replay


def create_app(
    settings: Settings, loader: Callable[[Settings], LoadedModel] = load_model
) -> FastAPI:
    """An app for these settings. Its startup only begins loading the model, in a thread: the
    server answers at once, /health with 503 "loading" until the engine runs."""
    settings.validate()
    warn_about_admin_scope(settings)
    metrics = Metrics(by_model=settings.serves_many)
    models = ModelRegistry(settings, metrics, loader)  # server.models: one model, or several
    state = models.state(None)  # the default model's
    fine_tuning = FineTuning(settings, state) if settings.enable_fine_tuning else None
    tracer = start_tracing(settings.otlp_traces_endpoint)  # None: OpenTelemetry never imported

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        models.start()
        worker = asyncio.create_task(fine_tuning.run()) if fine_tuning is not None else None
        try:
            yield
        finally:
            if worker is not None:  # a running job's process is stopped (failed at restart)
                worker.cancel()
                await asyncio.gather(worker, return_exceptions=True)
            await asyncio.to_thread(models.stop)
            if tracer is not None:  # the last spans go out
                await asyncio.to_thread(tracer.shutdown)

    app = FastAPI(
        title="gptserve",
        description="OpenAI-compatible text generation (see docs/API.md).",
        version="0.1.0",
        lifespan=lifespan,
    )
    app.state.server = state  # the default model's (the only one's, with one --model)
    app.state.models = models  # every model by name: handlers acquire theirs from it
    app.state.fine_tuning = fine_tuning  # None: /v1/files and /v1/fine_tuning answer 404
    app.state.tracer = tracer  # server.request_log records each request's span with it
    app.state.responses = ResponseStore(settings.responses_store_size)  # server.responses
    install_error_handlers(app)

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it; the request was aborted

    app.include_router(openai_router)
    app.include_router(embeddings_router)
    app.include_router(responses_router)
    app.include_router(messages_router)
    app.include_router(lora_router)
    app.include_router(files_router)
    app.include_router(fine_tuning_router)
    app.include_router(ollama_router)  # Ollama's /api/* (server.ollama)
    _add_routes(app, models)
    if STATIC_DIR.is_dir():
        app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    app.add_middleware(ModelLeases, registry=models)  # a request's model stays until it ends
    app.add_middleware(AdmissionControl, settings=settings, metrics=metrics)
    install_request_ids(app)  # X-Request-Id around everything, Starlette's 500s included
    app.add_middleware(AnthropicErrorShape)  # outside the gate: its 401/413/429 are reshaped too
    app.add_middleware(OllamaErrorShape)  # the same for /api/*: {"error": "..."}
    return app


def _add_routes(app: FastAPI, models: ModelRegistry) -> None:
    started = int(time.time())
    state = models.state(None)  # the default model's

    @app.get(
        "/health",
        response_model=HealthResponse,
        responses={**ERROR_RESPONSES, 503: {"model": HealthResponse, "description": "not ready"}},
    )
    async def health() -> JSONResponse:
        status, body = state.health() if not models.many else _many_health(models)
        return JSONResponse(body, status_code=status)

    @app.get(
        "/metrics",
        response_class=Response,
        responses={
            200: {"content": {"text/plain": {"schema": {"type": "string"}}}},
            **ERROR_RESPONSES,
        },
    )
    async def metrics() -> Response:
        return Response(models.metrics.render(), media_type=models.metrics.content_type)

    @app.get("/v1/models", response_model=ModelList, responses=ERROR_RESPONSES)
    async def list_models(request: Request) -> dict:
        if not models.many:
            state.require_ready()
        paths = is_admin(request)  # `root` is where a model was read from for admins, else its id
        tenant = request.scope.get(TENANT_SCOPE_KEY)
        data = []
        for spec in models.specs():
            model = models.state(spec.name or None)
            base = spec.name or model.loaded.name
            async_engine = model.async_engine
            card = {
                "id": base,
                "object": "model",
                "created": started,
                "owned_by": "gptserve",
                "max_model_len": async_engine.limits.max_model_len if async_engine else None,
                "root": (str(model.loaded.path) if model.loaded else spec.source)
                if paths
                else base,
                "parent": None,
                "loaded": async_engine is not None,
            }
            if spec.error is not None:  # a model of --models-dir that cannot be served
                card["error"] = (
                    spec.error
                    if paths or not models.settings.auth_keys
                    else ("it cannot be served: the server log has the reason")
                )
            adapters = [  # each LoRA adapter is a model of its own, its parent the base (as vLLM)
                {**card, "id": name, "root": source if paths else name, "parent": base}
                for name, source in list(model.lora_names.items())
                if model.may_use(name, tenant)  # own fine-tuned models
            ]
            data += [card, *adapters]
        return {"object": "list", "data": data}

    @app.post("/tokenize", response_model=TokenizeResponse, responses=ERROR_RESPONSES)
    async def tokenize(body: TokenizeRequest) -> dict:
        model = await models.acquire(body.model)
        async_engine = model.require_ready()
        tokens = model.validator.tokenize(body)
        return {
            "tokens": tokens,
            "count": len(tokens),
            "max_model_len": async_engine.limits.max_model_len,
        }

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=ERROR_RESPONSES)
    async def detokenize(body: DetokenizeRequest) -> dict:
        model = await models.acquire(body.model)
        model.require_ready()
        return {"prompt": model.loaded.tokenizer.decode(model.validator.detokenize(body))}

    @app.get("/", include_in_schema=False)
    async def playground() -> Response:
        index = STATIC_DIR / "index.html"
        if not index.is_file():
            raise APIError(
                404, "no playground is installed (server/static/index.html)", code="not_found"
            )
        return FileResponse(index)


def _many_health(models: ModelRegistry) -> tuple[int, dict]:
    """A server of several models is healthy while its registry works: each model loads on
    demand, and one that fails to load fails only its own requests. The counts are the loaded
    models' together."""
    loaded = [state.async_engine for _, state in models.loaded()]
    body = {
        "status": "ok",
        "model": models.default_name(),
        "failed_steps": sum(e.num_failed_steps for e in loaded if e.engine is not None),
        "running": sum(e.num_running for e in loaded if e.engine is not None),
        "waiting": sum(e.num_waiting for e in loaded if e.engine is not None),
    }
    if not models.running():
        return 503, {**body, "status": "failed", "error": "the model registry has stopped"}
    return 200, body
