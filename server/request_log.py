"""A finished request's account: one INFO line, `finished ...`, and its span (with
--otlp-traces-endpoint).

`RequestLog.begin` is called when a request is admitted; `finish` where it ends: the completions,
chat and Responses endpoints end through `ChoiceTracker.finish` (server.streams), which also
counts the request for the metrics, and embeddings where they count theirs. Timings use the
metrics' clock: from the request's admission (after its checks), as the Prometheus histograms
measure them. The line's `extra` fields (JSON with --log-format json): request_id, endpoint,
response_id, model, status, finish_reason, prompt_tokens, completion_tokens, queue_s, ttft_s,
total_s.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fastapi import Request
from gptserve.server.request_ids import ARRIVAL_KEY, current_request_id
from gptserve.server.tracing import TRACE_HEADERS, RequestTracer

if TYPE_CHECKING:
    from gptserve.engine.sampler import SamplingParams

log = logging.getLogger(__name__)
# the metrics' endpoint label -> the GenAI conventions' gen_ai.operation.name
OPERATIONS = {
    "completion": "text_completion", "chat": "chat", "responses": "chat",
    "embeddings": "embeddings",
}  # fmt: skip


def _seconds(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


@dataclass
class RequestLog:
    """What a request's account needs that its end does not know."""

    endpoint: str  # the metrics' label: completion, chat, responses, embeddings
    response_id: str  # the answer's id (chatcmpl-..., cmpl-..., ...)
    model: str  # the model it asked for (a LoRA adapter's name, or the base's)
    prompt_tokens: int
    started: float  # time.perf_counter() at admission
    params: SamplingParams | None = None
    request_id: str | None = None  # X-Request-Id
    arrival: float | None = None  # time.perf_counter() at its arrival (server.request_ids)
    trace_headers: dict[str, str] = field(default_factory=dict)
    tracer: RequestTracer | None = None
    done: bool = False

    @classmethod
    def begin(
        cls, request: Request, endpoint: str, response_id: str, model: str, prompt_tokens: int,
        started: float, params: SamplingParams | None = None,
    ) -> RequestLog:  # fmt: skip
        """The account of `request`, admitted at `started`."""
        tracer = getattr(request.app.state, "tracer", None)
        headers = request.headers
        trace = {h: headers[h] for h in TRACE_HEADERS if h in headers} if tracer else {}
        return cls(
            endpoint, response_id, model, prompt_tokens, started, params,
            current_request_id.get(), request.scope.get(ARRIVAL_KEY), trace, tracer,
        )  # fmt: skip

    def finish(
        self,
        status: int | str,
        finish_reason: str | None = None,
        finish_reasons: list[str] | None = None,
        completion_tokens: int = 0,
        first_token_at: float | None = None,
        scheduled_at: float | None = None,
    ) -> None:
        """Log the request's line and record its span, once. `status`: the HTTP status it ended
        with, or "disconnected"; `finish_reason`: the metrics' (one for the request);
        `finish_reasons`: each choice's; `first_token_at`, `scheduled_at`: perf_counter() times
        of its first token and of the engine's first step on it."""
        if self.done:
            return
        self.done = True
        now = time.perf_counter()
        try:
            self._finish(
                now, status, finish_reason, finish_reasons or [], completion_tokens,
                first_token_at, scheduled_at,
            )  # fmt: skip
        except Exception:  # an account must never fail its request
            log.exception("could not log the end of request %s", self.response_id)

    def _finish(
        self, now: float, status: int | str, finish_reason: str | None,
        finish_reasons: list[str], completion_tokens: int, first_token_at: float | None,
        scheduled_at: float | None,
    ) -> None:  # fmt: skip
        total = now - self.started
        ttft = None if first_token_at is None else first_token_at - self.started
        queue = None if scheduled_at is None else max(0.0, scheduled_at - self.started)
        fields = {
            "request_id": self.request_id,
            "endpoint": self.endpoint,
            "response_id": self.response_id,
            "model": self.model,
            "status": status,
            "finish_reason": finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "queue_s": _seconds(queue),
            "ttft_s": _seconds(ttft),
            "total_s": _seconds(total),
        }
        first = "" if ttft is None else f", first token {ttft:.3f} s"
        log.info(
            "finished %s request %s: status %s, finish_reason %s, %d prompt + %d completion "
            "tokens%s, total %.3f s", self.endpoint, self.response_id, status, finish_reason,
            self.prompt_tokens, completion_tokens, first, total, extra=fields,
        )  # fmt: skip
        if self.tracer is not None:
            self._span(now, status, finish_reasons, completion_tokens, queue, ttft, total)

    def _span(
        self, now: float, status: int | str, finish_reasons: list[str], completion_tokens: int,
        queue: float | None, ttft: float | None, total: float,
    ) -> None:  # fmt: skip
        end_ns = time.time_ns()  # the span: from the request's arrival (else admission) to now
        arrival = self.started if self.arrival is None else self.arrival
        start_ns = end_ns - int((now - arrival) * 1e9)
        operation = OPERATIONS.get(self.endpoint, "chat")  # another chat-shaped API's: chat
        p = self.params
        attributes = {
            "gen_ai.operation.name": operation,
            "gen_ai.request.model": self.model,
            "gen_ai.response.model": self.model,
            "gen_ai.response.id": self.response_id,
            "gen_ai.request.id": self.request_id,  # X-Request-Id (vLLM's attribute name)
            "gen_ai.usage.input_tokens": self.prompt_tokens,
            "gen_ai.usage.output_tokens": completion_tokens,
            "gen_ai.response.finish_reasons": finish_reasons or None,
            "gen_ai.request.max_tokens": None if p is None else p.max_tokens,
            "gen_ai.request.temperature": None if p is None else p.temperature,
            "gen_ai.request.top_p": None if p is None else p.top_p,
            "gen_ai.request.seed": None if p is None else p.seed,
            "gen_ai.request.choice.count": None if p is None or p.n == 1 else p.n,
            "gen_ai.server.queue_time": queue,
            "gen_ai.server.time_to_first_token": ttft,
            "gen_ai.server.request.duration": total,
            "http.response.status_code": status if isinstance(status, int) else None,
            "error.type": None if status == 200 else str(status),
            "gptserve.endpoint": self.endpoint,
        }
        failed = isinstance(status, int) and status >= 500
        self.tracer.record(
            f"{operation} {self.model}", start_ns, end_ns, self.trace_headers, attributes,
            error=f"status {status}" if failed else None,
        )  # fmt: skip
