"""Property-based fuzzing of the HTTP API from its own OpenAPI schema (schemathesis 4).

Every operation gets a bounded, derandomized number of generated requests, both ones that fit
the schema and ones that do not, sent to a real server. Each answer must not be a 5xx, must have a
status, content type and body that the schema declares, and every error body must be OpenAI's
`{"error": {"message", "type", "param", "code"}}` (Anthropic's `{"type": "error", "error":
{"type", "message"}}` under /v1/messages, Ollama's `{"error": "..."}` under /api/). The server's
limits are set low so that the requests the fuzzer gets accepted stay cheap on a CPU.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import schemathesis
from gptserve.server.settings import Settings
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import (
    content_type_conformance,
    negative_data_rejection,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.core.transport import Response
from schemathesis.generation import GenerationMode

from tests.server.conftest import API_KEY, LiveServer, live_server

MAX_EXAMPLES = 25
OPERATIONS = [
    "POST /v1/completions",
    "POST /v1/chat/completions",
    "POST /v1/embeddings",
    "POST /v1/responses",
    "GET /v1/responses/{response_id}",
    "DELETE /v1/responses/{response_id}",
    "GET /v1/responses/{response_id}/input_items",
    "POST /v1/load_lora_adapter",
    "POST /v1/unload_lora_adapter",
    "POST /v1/messages",
    "POST /v1/messages/count_tokens",
    "POST /tokenize",
    "POST /detokenize",
    "GET /v1/models",
    "GET /health",
    "GET /metrics",
    "POST /api/chat",
    "POST /api/generate",
    "POST /api/embed",
    "POST /api/embeddings",
    "POST /api/show",
    "GET /api/tags",
    "GET /api/ps",
    "GET /api/version",
    "POST /v1/files",
    "GET /v1/files",
    "GET /v1/files/{file_id}",
    "GET /v1/files/{file_id}/content",
    "DELETE /v1/files/{file_id}",
    "POST /v1/fine_tuning/jobs",
    "GET /v1/fine_tuning/jobs",
    "GET /v1/fine_tuning/jobs/{fine_tuning_job_id}",
    "GET /v1/fine_tuning/jobs/{fine_tuning_job_id}/events",
    "GET /v1/fine_tuning/jobs/{fine_tuning_job_id}/checkpoints",
    "POST /v1/fine_tuning/jobs/{fine_tuning_job_id}/cancel",
]
# operations no generated request can succeed on: an id, an adapter or a file the fuzzer cannot
# know (a job needs an uploaded file's id, an upload chat JSONL)
NO_SUCCESS = {
    "POST /v1/files",
    "GET /v1/files/{file_id}",
    "GET /v1/files/{file_id}/content",
    "DELETE /v1/files/{file_id}",
    "POST /v1/fine_tuning/jobs",
    "GET /v1/fine_tuning/jobs/{fine_tuning_job_id}",
    "GET /v1/fine_tuning/jobs/{fine_tuning_job_id}/events",
    "GET /v1/fine_tuning/jobs/{fine_tuning_job_id}/checkpoints",
    "POST /v1/fine_tuning/jobs/{fine_tuning_job_id}/cancel",
    "GET /v1/responses/{response_id}",
    "DELETE /v1/responses/{response_id}",
    "GET /v1/responses/{response_id}/input_items",
    "POST /v1/load_lora_adapter",
    "POST /v1/unload_lora_adapter",
}
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


@pytest.fixture(scope="module")
def fuzz_server(
    tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    limits = Settings(
        model=str(tiny_checkpoint),
        admin_api_keys=[API_KEY],  # run-time LoRA loading is fuzzed past its permission check
        enable_lora_loading=True,
        lora_roots=[str(tmp_path_factory.mktemp("lora-root"))],
        max_tokens_limit=8,
        max_n=2,
        max_prompts=2,
        max_num_seqs=8,
        request_timeout=60,
        enable_fine_tuning=True,  # the files and jobs API (a job the fuzzer made would train 1 step)
        state_dir=str(tmp_path_factory.mktemp("ft-state")),
        fine_tune_max_steps=1,
    )
    with live_server(limits) as live:
        yield live


@pytest.fixture(scope="module")
def schema(fuzz_server: LiveServer) -> schemathesis.schemas.BaseSchema:
    return schemathesis.openapi.from_url(f"{fuzz_server.url}/openapi.json")


def content_type(response: Response) -> str:
    values = {k.lower(): v for k, v in response.headers.items()}.get("content-type", [""])
    return values[0]


def check_error_shape(response: Response, anthropic: bool = False, ollama: bool = False) -> None:
    if response.status_code < 400:
        return
    assert content_type(response).startswith("application/json"), response.headers
    body = json.loads(response.content)
    if ollama:  # Ollama's paths (/api/*)
        assert set(body) == {"error"} and isinstance(body["error"], str) and body["error"], body
        return
    if anthropic:  # the Messages API's paths
        assert set(body) == {"type", "error"} and body["type"] == "error", body
        assert set(body["error"]) == {"type", "message"} and body["error"]["message"], body
        return
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str)
    assert err["param"] is None or isinstance(err["param"], str)
    assert err["code"] is None or isinstance(err["code"], str)


def check_stream(response: Response) -> None:
    """An SSE answer: `data:` events of JSON objects, the last one `[DONE]`; or the Responses
    API's typed events (`event:` and `data:`), the last one its end or an error; or the Messages
    API's named events, each `type` its event's name, the last message_stop or an error."""
    if not content_type(response).startswith("text/event-stream"):
        return
    text = response.content.decode()
    blocks = [block for block in text.split("\n\n") if block]
    if blocks and blocks[0].startswith("event: message_start"):  # Anthropic's named events
        named = [block.split("\n", 1) for block in blocks]
        for head, data in named:
            assert json.loads(data.removeprefix("data: "))["type"] == head.removeprefix("event: ")
        assert named[-1][0] in ("event: message_stop", "event: error"), text[-200:]
        return
    if blocks and blocks[0].startswith("event: "):
        typed = [json.loads(block.split("\ndata: ", 1)[1]) for block in blocks]
        assert [e["sequence_number"] for e in typed] == list(range(len(typed)))
        assert typed[-1]["type"] in ("response.completed", "response.incomplete", "error")
        return
    events = [line[6:] for line in blocks if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", text[-200:]
    for event in events[:-1]:
        obj = json.loads(event)
        assert "choices" in obj or "error" in obj, obj
        if "error" in obj:
            assert set(obj["error"]) == {"message", "type", "param", "code"}


# Operations without parameters or a body have no invalid input to generate (a job's cancel:
# no body, and any string is a job id to look up).
NO_INVALID_INPUT = {"POST /v1/fine_tuning/jobs/{fine_tuning_job_id}/cancel"}
CASES = [(label, GenerationMode.POSITIVE) for label in OPERATIONS] + [
    (label, GenerationMode.NEGATIVE)
    for label in OPERATIONS
    if label.startswith("POST") and label not in NO_INVALID_INPUT
]


@pytest.mark.parametrize(("label", "mode"), CASES, ids=[f"{l} {m.value}" for l, m in CASES])
def test_operation_fuzz(
    schema: schemathesis.schemas.BaseSchema,
    fuzz_server: LiveServer,
    label: str,
    mode: GenerationMode,
) -> None:
    operation = schema.find_operation_by_label(label)
    assert operation is not None, f"{label} is missing from the OpenAPI schema"
    checks = CHECKS + ([negative_data_rejection] if mode is GenerationMode.NEGATIVE else [])
    session = requests.Session()
    statuses: list[int] = []

    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def fuzz(case: schemathesis.Case) -> None:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        response = case.call(base_url=fuzz_server.url, session=session, headers=headers, timeout=60)
        statuses.append(response.status_code)
        case.validate_response(response, checks=checks, headers=headers)
        check_error_shape(
            response,
            anthropic=label.startswith("POST /v1/messages"),
            ollama=label.split(" ")[1].startswith("/api/"),
        )
        check_stream(response)

    fuzz()
    assert statuses, "the fuzzer sent no request"
    if mode is GenerationMode.POSITIVE and label not in NO_SUCCESS:  # the success path too
        assert 200 in statuses, statuses


def test_every_operation_is_fuzzed(schema: schemathesis.schemas.BaseSchema) -> None:
    """A new endpoint joins OPERATIONS, or this fails."""
    served = {op.ok().label for op in schema.get_all_operations()}
    assert served == set(OPERATIONS), sorted(served ^ set(OPERATIONS))


def test_fuzzing_left_the_server_clean(fuzz_server: LiveServer) -> None:
    """After every generated request: no 500 was ever answered and every KV block is free."""
    metrics = requests.get(f"{fuzz_server.url}/metrics", timeout=10).text
    assert 'gptserve_http_responses_total{status="500"}' not in metrics
    assert fuzz_server.wait_blocks_free()
