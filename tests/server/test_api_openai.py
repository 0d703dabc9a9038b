"""The official openai client against a live server: shapes, streaming, logprobs, error classes."""

from __future__ import annotations

import httpx
import openai
import pytest

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


def test_completion_logprobs(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=MODEL_NAME, prompt="The", max_tokens=4, logprobs=3, extra_body={"ignore_eos": True}
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(top) == 3 for top in lp.top_logprobs)
    assert all(x <= 0 for x in lp.token_logprobs)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert "".join(lp.tokens) == out.choices[0].text


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
        max_tokens=5, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    msg = out.choices[0].message
    assert msg.role == "assistant" and isinstance(msg.content, str)
    content = out.choices[0].logprobs.content
    assert 1 <= len(content) <= 5
    assert all(
        len(c.top_logprobs) == 2 and bytes(c.bytes).decode("utf-8", "replace") for c in content
    )
    # the default template renders "System: Be brief.\nUser: Hi\nAssistant:"
    prompt = "System: Be brief.\nUser: Hi\nAssistant:"
    tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": prompt}, headers=headers).json()
    assert out.usage.prompt_tokens == tokens["count"]


def test_chat_stream_n2(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Tell me"}], n=2, max_tokens=6,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True, "stop": []},
    )  # fmt: skip
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
    assert set(finish) == {0, 1}
    assert usage is not None and usage.completion_tokens <= 12


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
