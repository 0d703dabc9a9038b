"""Admission is one call: an HTTP request is checked by `RequestLimits.admit` once (by the
server, naming its own fields), and the engine takes what was admitted without checking again."""

from __future__ import annotations

import httpx
import pytest
from gptserve.engine.limits import RequestLimits

from tests.server.conftest import LiveServer


@pytest.fixture()
def admissions(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    calls: list[tuple] = []
    real = RequestLimits.admit

    def counted(self, prompts, params, names=None, constrained=False):  # noqa: ANN001, ANN202
        calls.append((len(prompts), names))
        return real(self, prompts, params, *([names] if names is not None else []), constrained)

    monkeypatch.setattr(RequestLimits, "admit", counted)
    return calls


def test_a_request_is_admitted_once(server: LiveServer, headers, admissions) -> None:
    body = {"prompt": ["To be", "or not"], "max_tokens": 3, "n": 2}
    r = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=30)
    assert r.status_code == 200 and len(r.json()["choices"]) == 4
    assert len(admissions) == 1 and admissions[0][0] == 2  # both prompts, in one call
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 3}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=chat, headers=headers, timeout=30)
    assert r.status_code == 200 and len(admissions) == 2
    names = admissions[1][1]
    assert (names.prompt, names.max_tokens, names.logprobs) == (
        "messages", "max_completion_tokens", "top_logprobs",
    )  # fmt: skip


def test_a_refusal_names_the_field_the_client_sent(server: LiveServer, headers) -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10**6}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=chat, headers=headers, timeout=30)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "max_completion_tokens"
    assert err["code"] == "context_length_exceeded"
