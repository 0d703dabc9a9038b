"""The official openai client against a live server: shapes, streaming, logprobs, error classes."""

from __future__ import annotations

import math

import httpx
import openai
import pytest
import torch

from tests.server.conftest import API_KEY, MODEL_NAME, LiveServer


@pytest.fixture()
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=30)


def test_models_list(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]


def test_completion_exact_length_and_usage(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=MODEL_NAME, prompt="Hello there", max_tokens=7, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert out.object == "text_completion" and out.id.startswith("cmpl-")
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 7
    assert out.usage.prompt_tokens == 2  # "Hello", " there"
    assert out.usage.total_tokens == 9
    again = client.completions.create(
        model=MODEL_NAME, prompt="Hello there", max_tokens=7, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert again.choices[0].text == out.choices[0].text  # greedy is deterministic


def test_completion_n2_multiple_prompts(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=MODEL_NAME, prompt=["a", "b c"], n=2, max_tokens=3, seed=1,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    assert out.usage.completion_tokens == 12
    ids = client.completions.create(
        model=MODEL_NAME,
        prompt=[[464, 3290], [50256]],
        max_tokens=2,
        extra_body={"ignore_eos": True},
    )
    assert ids.usage.prompt_tokens == 3 and len(ids.choices) == 2


def test_completion_logprobs(server: LiveServer, client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=MODEL_NAME, prompt="The", max_tokens=4, logprobs=3, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    lp = out.choices[0].logprobs
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        ranked = sorted(top.items(), key=lambda kv: -kv[1])
        assert len(ranked) == 3 and ranked[0] == (token, logprob)  # greedy takes the best
        assert sum(math.exp(v) for v in top.values()) <= 1 + 1e-6
    # the same tokens scored as a prompt get the same logprobs
    ids = httpx.post(
        f"{server.url}/tokenize",
        json={"prompt": "The" + out.choices[0].text},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=10,
    ).json()["tokens"]
    assert len(ids) == 5  # this model's greedy text tokenizes back into its 1 + 4 tokens
    scored = client.completions.create(
        model=MODEL_NAME, prompt=ids, max_tokens=0, echo=True, logprobs=0
    ).choices[0]
    assert scored.logprobs.tokens == ["The", *lp.tokens]
    exact = next(server.engine.model.parameters()).dtype == torch.float32
    tolerance = 1e-3 if exact else 3e-2  # prefill and decode round differently in 16 bits
    assert scored.logprobs.token_logprobs[1:] == pytest.approx(lp.token_logprobs, abs=tolerance)


def test_echo_scores_prompt(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=MODEL_NAME, prompt="one two three", max_tokens=0, echo=True, logprobs=1
    )
    choice = out.choices[0]
    assert choice.text == "one two three"
    assert choice.logprobs.tokens == ["one", " two", " three"]
    assert choice.logprobs.token_logprobs[0] is None
    assert all(x < 0 for x in choice.logprobs.token_logprobs[1:])
    assert choice.logprobs.text_offset == [0, 3, 7]
    assert out.usage.completion_tokens == 0


def test_completion_stream_with_usage(client: openai.OpenAI) -> None:
    stream = client.completions.create(
        model=MODEL_NAME, prompt="Once", max_tokens=9, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 9
    finishes = [c.choices[0].finish_reason for c in chunks[:-1]]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])


def test_chat(server: LiveServer, client: openai.OpenAI, headers: dict[str, str]) -> None:
    out = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        max_tokens=5, logprobs=True, top_logprobs=2, temperature=0, extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    choice = out.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    content = choice.logprobs.content
    assert len(content) == out.usage.completion_tokens == 5
    raw = b"".join(bytes(c.bytes) for c in content)
    assert raw.decode("utf-8", "replace") == choice.message.content
    for entry in content:
        assert entry.top_logprobs[0].token == entry.token  # greedy: the best alternative
        assert entry.top_logprobs[0].logprob == entry.logprob
        assert entry.top_logprobs[1].logprob <= entry.logprob <= 0
        assert bytes(entry.bytes) == bytes(entry.top_logprobs[0].bytes)
    # the default template renders "System: Be brief.\nUser: Hi\nAssistant:"
    prompt = "System: Be brief.\nUser: Hi\nAssistant:"
    tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": prompt}, headers=headers).json()
    assert out.usage.prompt_tokens == tokens["count"]
    # and the chat answer is the completion of that prompt
    same = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=5, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert same.choices[0].text == choice.message.content


def test_chat_stream_n2(client: openai.OpenAI) -> None:
    request = dict(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Tell me"}], n=2, max_tokens=6,
        seed=11, extra_body={"ignore_eos": True},
    )  # fmt: skip
    stream = client.chat.completions.create(
        **request, stream=True, stream_options={"include_usage": True}
    )
    roles, texts, finish = {}, {0: "", 1: ""}, {}
    usage = None
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            if c.delta.role:
                roles[c.index] = c.delta.role
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert roles == {0: "assistant", 1: "assistant"}
    whole = client.chat.completions.create(**request)  # same seed: the same two completions
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert finish == {c.index: c.finish_reason for c in whole.choices}
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens
    if set(finish.values()) == {"length"}:
        assert usage.completion_tokens == 12


def test_stop_strings_wait_for_min_tokens(client: openai.OpenAI) -> None:
    request = dict(model=MODEL_NAME, prompt=[464], max_tokens=8, temperature=0, logprobs=0)
    greedy = client.completions.create(**request, extra_body={"ignore_eos": True})
    stop = greedy.choices[0].logprobs.tokens[0]  # the first token's text
    assert stop and not stop.startswith("bytes:")
    early = client.completions.create(**request, stop=[stop], extra_body={"ignore_eos": True})
    assert early.choices[0].finish_reason == "stop" and early.usage.completion_tokens == 1
    late = client.completions.create(
        **request, stop=[stop], extra_body={"ignore_eos": True, "min_tokens": 5}
    )
    choice = late.choices[0]
    assert late.usage.completion_tokens >= 5
    assert choice.text.startswith(stop)  # the stop string of token 1 is text now
    assert greedy.choices[0].text.startswith(choice.text)
    if choice.finish_reason == "stop":  # a later occurrence, ending in token 5 or after
        tokens = greedy.choices[0].logprobs.tokens
        assert stop in "".join(tokens[: late.usage.completion_tokens])[len(choice.text) :]


def test_error_classes(server: LiveServer, client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL_NAME, prompt="x", temperature=-1)
    assert exc.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL_NAME, prompt="x " * 200, max_tokens=100)
    assert exc.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError) as exc:
        client.completions.create(model="gpt-4", prompt="x")
    assert exc.value.body["code"] == "model_not_found"
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0, timeout=10)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL_NAME, prompt="x", best_of=2)
    assert exc.value.body["param"] == "best_of"
