"""A call that repeats an earlier call of the same answer ends the answer, on every API that
makes calls: chat completions whole and streamed, the Responses API whole and streamed.

A tiny random model does not repeat itself on cue, so its sampler is scripted: each of the
request's tokens is forced (its logit raised, through the real sampler and the tool grammar's
mask) to the next of the same `get_weather` call written four times, as a small model under
`tool_choice: "required"` with parallel calls writes it until `max_tokens`. The answer must be
that call once, finish reason `tool_calls` (Responses: `completed`), and the engine must have
stopped the sequence at the repeat: far fewer tokens spent than the script holds.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from gptserve.engine import engine as engine_module
from gptserve.server.settings import Settings

from tests.server.chat.tools.test_tools import (  # noqa: F401 (fixtures)
    WEATHER,
    chatml_checkpoint,
    client_of,
)
from tests.server.conftest import LiveServer, live_server
from tests.server.test_responses import FLAT_WEATHER, streamed

QUESTION = "What is the weather in Paris? Use celsius."
PARIS = '{"city":"Paris","unit":"celsius"}'
CALL = f'<tool_call>\n{{"name":"get_weather","arguments":{PARIS}}}\n</tool_call>'
TIMES = 4


@pytest.fixture(scope="module")
def chatml(chatml_checkpoint: Path) -> Iterator[LiveServer]:  # noqa: F811
    with live_server(Settings(model=str(chatml_checkpoint), max_num_seqs=8)) as live:
        yield live


class Script:
    """CALL written TIMES times, and what the scripted sampler saw: the characters a sequence
    had written before each of its tokens."""

    text = "\n".join([CALL] * TIMES)

    def __init__(self) -> None:
        self.written: list[int] = []

    def tokens_to(self, chars: int) -> float:
        """How many tokens the sequence had generated when its text reached `chars` (infinity:
        it never did)."""
        return next((n for n, done in enumerate(self.written) if done >= chars), math.inf)

    def check_stopped(self, live: LiveServer, used: int) -> None:
        """The sequence ended at the repeat (the end of the second call's arguments), a token
        or two later at most, the third call never written whole; the engine holds nothing."""
        ends = [m.end() for m in re.finditer(re.escape(PARIS), self.text)]
        assert self.tokens_to(ends[1]) <= used < self.tokens_to(ends[2]), (used, self.written)
        assert live.state.async_engine.num_running == 0


@pytest.fixture()
def script(chatml: LiveServer, monkeypatch: pytest.MonkeyPatch) -> Script:
    """Every sequence's text forced to Script.text: at each step the longest token the grammar
    allows that goes on with the script's text is raised above the rest (the grammar writes its
    fixed parts in its own tokens)."""
    tokenizer, out = chatml.state.loaded.tokenizer, Script()
    pieces = [tokenizer.decode([t]) for t in range(tokenizer.vocab_size)]
    real: Callable = engine_module.sample

    def scripted(logits: torch.Tensor, rows: list, allowed: torch.Tensor | None = None):  # noqa: ANN202
        logits = logits.clone()
        for i, row in enumerate(rows):
            written = len(tokenizer.decode(row.output_ids))
            out.written[len(row.output_ids) :] = [written]
            rest = out.text[written:]
            fits = [t for t, piece in enumerate(pieces) if piece and rest.startswith(piece)
                    and (allowed is None or allowed[i, t])]  # fmt: skip
            if fits:
                logits[i, max(fits, key=lambda t: len(pieces[t]))] += 1e4
        return real(logits, rows, allowed)

    monkeypatch.setattr(engine_module, "sample", scripted)
    return out


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_chat_a_repeated_call_ends_the_answer(
    chatml: LiveServer, script: Script, stream: bool
) -> None:
    budget = len(script.text)  # past the script's end, were it not stopped
    body = dict(model=chatml.state.loaded.name, messages=[{"role": "user", "content": QUESTION}],
                tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=budget)  # fmt: skip
    client = client_of(chatml)
    if not stream:
        answer = client.chat.completions.create(**body)
        choice, usage = answer.choices[0], answer.usage
        finish, content = choice.finish_reason, choice.message.content
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    else:
        chunks = list(client.chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **body))  # fmt: skip
        usage, pieces = chunks[-1].usage, {}
        finishes = [c.choices[0].finish_reason for c in chunks[:-1]]
        assert finishes[-1] is not None and set(finishes[:-1]) == {None}  # one end, the last
        finish, content = finishes[-1], None
        for chunk in chunks[:-1]:
            delta = chunk.choices[0].delta
            content = delta.content if delta.content is not None else content
            for item in delta.tool_calls or []:
                name, arguments = pieces.get(item.index, ("", ""))
                pieces[item.index] = (name + (item.function.name or ""),
                                      arguments + (item.function.arguments or ""))  # fmt: skip
        assert list(pieces) == [0]  # the repeat was never handed out
        calls = list(pieces.values())
    assert finish == "tool_calls" and content is None
    assert calls == [("get_weather", PARIS)]
    script.check_stopped(chatml, usage.completion_tokens)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_responses_a_repeated_call_ends_the_answer(
    chatml: LiveServer, script: Script, stream: bool
) -> None:
    budget = len(script.text)  # past the script's end, were it not stopped
    body = dict(model=chatml.state.loaded.name, input=QUESTION, tools=[FLAT_WEATHER],
                tool_choice="required", temperature=0, max_output_tokens=budget)  # fmt: skip
    if stream:
        events, response = streamed(chatml, **body)
        added = [e for e in events if e.type == "response.output_item.added"]
        assert len(added) == 1  # the repeat never opened an item
    else:
        response = client_of(chatml).responses.create(**body)
    assert response.status == "completed" and response.incomplete_details is None
    assert [(item.type, item.name, item.status) for item in response.output] == [
        ("function_call", "get_weather", "completed")
    ]
    assert json.loads(response.output[0].arguments) == json.loads(PARIS)
    script.check_stopped(chatml, response.usage.output_tokens)
