"""How a handler finds the model its request names (server.models.registry)."""

from __future__ import annotations

from fastapi import Request
from gptserve.server.runtime import ServerState


async def request_model(request: Request, name: str | None) -> ServerState:
    """The state of the model `name` names, loaded on demand and leased for the request: its
    base model for an adapter or a fine-tuned model; the default model for None. 404
    model_not_found for an unknown name on a server of several models."""
    return await request.app.state.models.acquire(name)
