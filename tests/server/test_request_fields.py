"""Fields a request may carry besides the ones this server reads: vLLM's that it does not honour
are a 400 naming them, other unknown fields are ignored with one warning line; a chat message's
`name` reaches the chat template."""

from __future__ import annotations

import logging
from typing import Any

import httpx
import pytest
from gptserve.model.tokenizers import get_tokenizer
from gptserve.server.chat.templates import ChatTemplate
from gptserve.server.request_fields import IGNORED_WARNING

from tests.server.conftest import LiveServer

COMPLETION = ("/v1/completions", {"prompt": "x", "max_tokens": 2})
CHAT = ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2})
BOTH = [COMPLETION, CHAT]


def send(server: LiveServer, headers: dict, endpoint: tuple[str, dict], **extra: Any):
    path, body = endpoint
    return httpx.post(server.url + path, json={**body, **extra}, headers=headers, timeout=60)


def ignored_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    prefix = IGNORED_WARNING.split("%s")[0]
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(prefix)]


ASKS_FOR_MORE = [
    ("use_beam_search", True),
    ("length_penalty", 0.5),
    ("include_stop_str_in_output", True),
    ("truncate_prompt_tokens", 5),
    ("allowed_token_ids", [1, 2]),
    ("bad_words", ["x"]),
    ("prompt_logprobs", 1),
    ("guided_decoding_backend", "outlines"),
    ("guided_whitespace_pattern", " "),
    ("structural_tag", "{}"),
    ("priority", 1),
    ("request_id", "mine"),
    ("logits_processors", ["my.module.Processor"]),
    ("return_tokens_as_token_ids", True),
    ("kv_transfer_params", {"x": 1}),
    ("vllm_xargs", {"x": 1}),
]


@pytest.mark.parametrize("endpoint", BOTH, ids=["completions", "chat"])
@pytest.mark.parametrize(("field", "value"), ASKS_FOR_MORE, ids=[f for f, _ in ASKS_FOR_MORE])
def test_a_vllm_field_this_server_does_not_honour_is_a_400_naming_it(
    server: LiveServer, headers: dict, endpoint: tuple, field: str, value: Any
) -> None:
    r = send(server, headers, endpoint, **{field: value})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"]
    assert "not supported" in err["message"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("echo", True), ("continue_final_message", True), ("add_generation_prompt", False),
        ("chat_template", "{{ messages }}"),
        ("documents", [{"title": "t", "text": "x"}]), ("tool_choice", "required"),
        ("reasoning_effort", "high"), ("best_of", 2),
    ],
)  # fmt: skip
def test_chat_only_vllm_fields_are_refused_on_chat(
    server: LiveServer, headers: dict, field: str, value: Any
) -> None:
    r = send(server, headers, CHAT, **{field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_every_refused_field_is_named_and_the_first_is_the_param(
    server: LiveServer, headers: dict
) -> None:
    r = send(server, headers, COMPLETION, prompt_logprobs=2, use_beam_search=True)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "prompt_logprobs"
    assert "prompt_logprobs" in err["message"] and "use_beam_search" in err["message"]
    r = send(server, headers, COMPLETION, prompt_embeds="AAAA")
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_embeds"


HONOURED_ANYWAY = {
    "use_beam_search": False, "length_penalty": 1.0, "include_stop_str_in_output": False,
    "skip_special_tokens": True, "spaces_between_special_tokens": True,
    "add_special_tokens": True, "priority": 0, "bad_words": [], "prompt_logprobs": None,
    "return_token_ids": False, "vllm_xargs": {}, "request_id": None,
}  # fmt: skip
CHAT_HONOURED_ANYWAY = {
    "echo": False, "add_generation_prompt": True, "continue_final_message": False,
    "tool_choice": "none", "parallel_tool_calls": True, "best_of": 1, "include_reasoning": True,
    "chat_template_kwargs": {},
}  # fmt: skip


def test_values_that_ask_for_what_the_server_does_are_accepted_without_a_warning(
    server: LiveServer, headers: dict, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="gptserve.server.request_fields"):
        r = send(server, headers, COMPLETION, **HONOURED_ANYWAY)
        assert r.status_code == 200, r.text
        r = send(server, headers, CHAT, **HONOURED_ANYWAY, **CHAT_HONOURED_ANYWAY)
        assert r.status_code == 200, r.text
    assert ignored_lines(caplog) == []


def test_true_is_not_one_and_ignore_eos_writes_special_tokens(
    server: LiveServer, headers: dict
) -> None:
    assert send(server, headers, COMPLETION, priority=False).status_code == 400
    assert send(server, headers, COMPLETION, use_beam_search=0).status_code == 400
    # with ignore_eos the end-of-text token is written as text: skipping it is not honoured
    r = send(server, headers, COMPLETION, skip_special_tokens=True, ignore_eos=True)
    assert r.status_code == 400 and r.json()["error"]["param"] == "skip_special_tokens"


LLAMA_CPP_SAMPLERS = {
    "typical_p": 0.9, "xtc_probability": 0.5, "xtc_threshold": 0.05, "dry_multiplier": 0.8,
    "dry_base": 1.75, "dry_allowed_length": 1, "dry_penalty_last_n": 64,
    "dry_sequence_breakers": ["\n", ":", "### Response"],
}  # fmt: skip


@pytest.mark.parametrize("endpoint", BOTH, ids=["completions", "chat"])
def test_llama_cpps_samplers_are_honoured_and_a_bad_value_is_a_400_naming_it(
    server: LiveServer, headers: dict, endpoint: tuple, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="gptserve.server.request_fields"):
        for extra in (LLAMA_CPP_SAMPLERS, {**LLAMA_CPP_SAMPLERS, "temperature": 0, "seed": 3}):
            r = send(server, headers, endpoint, **extra, max_tokens=4)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] >= 1
    assert ignored_lines(caplog) == []  # read, not ignored
    for field, bad in (("typical_p", 1.5), ("xtc_threshold", 2), ("dry_base", 0.5),
                       ("dry_sequence_breakers", ["ok", ""])):  # fmt: skip
        r = send(server, headers, endpoint, **{**LLAMA_CPP_SAMPLERS, field: bad})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == field and field in err["message"]


def test_the_llama_cpp_samplers_are_in_the_openapi_schema(server: LiveServer) -> None:
    schemas = httpx.get(server.url + "/openapi.json", timeout=10).json()["components"]["schemas"]
    for request in ("CompletionRequest", "ChatCompletionRequest"):
        assert set(LLAMA_CPP_SAMPLERS) <= set(schemas[request]["properties"]), request


@pytest.mark.parametrize("endpoint", BOTH, ids=["completions", "chat"])
def test_unknown_fields_are_ignored_with_one_warning_line_naming_them(
    server: LiveServer, headers: dict, endpoint: tuple, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="gptserve.server.request_fields"):
        r = send(server, headers, endpoint, frobnicate=1, service_tier="flex", store=False)
    assert r.status_code == 200, r.text
    lines = ignored_lines(caplog)
    assert lines == [
        "The following fields were present in the request but ignored: "
        "{'frobnicate', 'service_tier', 'store'}"
    ]


def test_the_warning_stays_one_short_line_for_many_or_hostile_names(
    server: LiveServer, headers: dict, caplog: pytest.LogCaptureFixture
) -> None:
    extra = {f"junk{i:02d}": i for i in range(40)}
    extra["x\nERROR forged line"] = 1
    extra["y" * 500] = 1
    with caplog.at_level(logging.WARNING, logger="gptserve.server.request_fields"):
        r = send(server, headers, COMPLETION, **extra)
    assert r.status_code == 200, r.text
    (line,) = ignored_lines(caplog)
    assert "\n" not in line and len(line) < 600
    assert "'junk00'" in line and "... 26 more}" in line


def test_continuous_usage_stats_is_refused_and_false_is_fine(
    server: LiveServer, headers: dict
) -> None:
    for endpoint in BOTH:
        options = {"include_usage": True, "continuous_usage_stats": True}
        r = send(server, headers, endpoint, stream=True, stream_options=options)
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options", r.text
        options["continuous_usage_stats"] = False
        r = send(server, headers, endpoint, stream=True, stream_options=options)
        assert r.status_code == 200, r.text


# ---- a chat message's name ---------------------------------------------------------------------


def test_the_name_is_the_speaker_in_the_default_template() -> None:
    template = ChatTemplate()
    messages = [("system", "Be brief."), ("user", "Who goes there?", "BERNARDO"), ("user", "hi")]
    assert template.render(messages) == (
        "System: Be brief.\nBERNARDO: Who goes there?\nUser: hi\nAssistant:"
    )
    assert template.render([("user", "hi", None)]) == "User: hi\nAssistant:"


def test_a_custom_template_gets_name_role_and_content_each_written_once() -> None:
    template = ChatTemplate.parse("<{role} name={name}>{content}</{Role}>\n---\n<assistant>")
    rendered = template.render([("user", "{name} {content}", "{content}"), ("assistant", "ok")])
    assert rendered == (
        "<user name={content}>{name} {content}</User>"
        "<assistant name=Assistant>ok</Assistant><assistant>"
    )


def test_a_messages_name_reaches_the_prompt_over_http(server: LiveServer, headers: dict) -> None:
    tok = get_tokenizer()
    for name, speaker in ((None, "User"), ("HORATIO", "HORATIO")):
        message = {"role": "user", "content": "Well, sit we down.", "name": name}
        r = send(server, headers, CHAT, messages=[message], max_tokens=1)
        assert r.status_code == 200, r.text
        expected = tok.encode(f"{speaker}: Well, sit we down.\nAssistant:")
        assert r.json()["usage"]["prompt_tokens"] == len(expected)
