"""Request fields this server does not read: refuse vLLM's that it does not honour, log the rest.

OpenAI's API ignores fields it does not know, and so does this server, with one warning line
that names them (vLLM logs the same line). A field that vLLM defines is different: it asks for a
behaviour, and a client that sends `use_beam_search: true` or `prompt_logprobs: 5` and silently
gets plain sampling would take the answer for what it asked. Such a field is a 400 naming it,
unless its value asks for what this server does anyway (null, or the value this server's
behaviour matches, usually vLLM's default).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from gptserve.model.tokenizers import Tokenizer
from gptserve.server.errors import bad_request
from gptserve.server.protocol import SamplingFields

log = logging.getLogger(__name__)

Endpoint = Literal["completion", "chat"]
IGNORED_WARNING = "The following fields were present in the request but ignored: %s"
MAX_NAMES_LOGGED = 16  # a body may hold thousands of made-up keys; the log line stays short
MAX_NAME_LENGTH = 64


@dataclass(frozen=True)
class Unhonoured:
    """A vLLM field this server does not implement: why, and the values it honours anyway."""

    why: str
    accepted: tuple[Any, ...] = ()  # besides null

    def accepts(self, value: Any) -> bool:
        return value is None or any(_same(value, ok) for ok in self.accepted)


def _same(value: Any, expected: Any) -> bool:
    """Equal and of the same JSON kind (true is not 1, 1 is 1.0)."""
    if isinstance(value, bool) or isinstance(expected, bool):
        return value is expected
    numbers = (int, float)
    if isinstance(value, numbers) != isinstance(expected, numbers):
        return False
    return value == expected


# vLLM's fields of both endpoints (vllm/entrypoints/openai/protocol.py)
_BOTH = {
    "use_beam_search": Unhonoured("beam search is not supported", (False,)),
    "length_penalty": Unhonoured("it applies to beam search, which is not supported", (1,)),
    "include_stop_str_in_output": Unhonoured("a stop string is never part of the output", (False,)),
    "spaces_between_special_tokens": Unhonoured("special tokens are decoded as they are", (True,)),
    "skip_special_tokens": Unhonoured("special tokens are written as text", (False,)),
    "truncate_prompt_tokens": Unhonoured("prompts are never truncated; a long one is a 400"),
    "allowed_token_ids": Unhonoured("use logit_bias or a structured-output constraint"),
    "bad_words": Unhonoured("use logit_bias", ([],)),
    "prompt_logprobs": Unhonoured("prompt logprobs come with echo and logprobs on completions"),
    "add_special_tokens": Unhonoured("prompts are encoded without special tokens", (False,)),
    "guided_decoding_backend": Unhonoured("there is one structured-output backend (llguidance)"),
    "guided_whitespace_pattern": Unhonoured("structured JSON is written without whitespace"),
    "structural_tag": Unhonoured("use json, regex or choice"),
    "priority": Unhonoured("requests are served in the order they arrive", (0,)),
    "request_id": Unhonoured("the response's id is the server's"),
    "logits_processors": Unhonoured("custom logits processors are not supported"),
    "return_tokens_as_token_ids": Unhonoured("tokens are written as text", (False,)),
    "return_token_ids": Unhonoured("tokens are written as text", (False,)),
    "kv_transfer_params": Unhonoured("disaggregated serving is not supported"),
    "vllm_xargs": Unhonoured("there are no custom extensions", ({},)),
    "mm_processor_kwargs": Unhonoured("there is no multimodal processor"),
}
_ENDPOINT: dict[Endpoint, dict[str, Unhonoured]] = {
    "completion": {
        "prompt_embeds": Unhonoured("prompts are text or token ids"),
    },
    "chat": {
        "best_of": Unhonoured("only 1", (1,)),
        "echo": Unhonoured("the reply never repeats the last message", (False,)),
        "add_generation_prompt": Unhonoured("the assistant's prefix is always added", (True,)),
        "continue_final_message": Unhonoured(
            "the reply is always a new assistant message", (False,)
        ),
        "documents": Unhonoured("the chat template takes no documents"),
        "chat_template": Unhonoured("the checkpoint's chat template is used"),
        "reasoning_effort": Unhonoured("the model does not reason in a separate channel"),
        "include_reasoning": Unhonoured("there is no separate reasoning", (True, False)),
    },
}


def check_extra_fields(req: SamplingFields, endpoint: Endpoint, tokenizer: Tokenizer) -> None:
    """A 400 naming the vLLM fields of `req` this server does not honour (the first is the
    `param`); one warning line naming any other unknown field."""
    known = {**_BOTH, **_ENDPOINT[endpoint]}
    either = (True, False)
    if tokenizer.bos_token_id is None:  # nothing to add: both values are what happens
        known["add_special_tokens"] = Unhonoured("", either)
    if not req.ignore_eos and set(tokenizer.special_token_ids) <= set(tokenizer.eos_token_ids):
        # the only special tokens end a completion before their text is written
        known["skip_special_tokens"] = Unhonoured("", either)
    refused, ignored = sort_extras(req.model_extra, known)
    options = req.stream_options
    if options is not None and options.continuous_usage_stats:
        refused.append(
            ("stream_options", Unhonoured("continuous_usage_stats: usage comes in the last chunk"))
        )
    refuse_or_log(refused, ignored)


def sort_extras(
    extra: dict[str, Any] | None, rules: Mapping[str, Unhonoured],
    accepted: Collection[str] = (), prefix: str = "",
) -> tuple[list[tuple[str, Unhonoured]], list[str]]:  # fmt: skip
    """A body's unknown fields (pydantic's `model_extra`) sorted: those a rule refuses (with the
    rule), and those with no rule and not `accepted`, to be logged; names get `prefix`."""
    refused, ignored = [], []
    for name, value in (extra or {}).items():
        rule = rules.get(name)
        if rule is None:
            if name not in accepted:
                ignored.append(prefix + name)
        elif not rule.accepts(value):
            refused.append((prefix + name, rule))
    return refused, ignored


def refuse_or_log(refused: list[tuple[str, Unhonoured]], ignored: list[str]) -> None:
    """A 400 naming the refused fields (the first is the `param`), else one warning line naming
    the ignored ones."""
    if refused:
        first, rule = refused[0]
        names = ", ".join(name for name, _ in refused)
        raise bad_request(f"not supported by this server: {names} ({first}: {rule.why})", first)
    if ignored:
        log.warning(IGNORED_WARNING, logged_names(ignored))


def refuse_unknown(extra: dict[str, Any] | None, what: str) -> None:
    """A 400 naming the first unknown field, for APIs where nothing may be ignored (fine-tuning:
    a field left out of a job would change what it trains without a word)."""
    names = list(extra or {})
    if names:
        shown = logged_names(names)
        raise bad_request(f"{what} has fields this server does not honour: {shown}", names[0])


def logged_names(names: list[str]) -> str:
    """{'a', 'b'} with each name cut short and at most MAX_NAMES_LOGGED of them (repr escapes
    newlines, so a made-up key cannot forge log lines)."""
    shown = [repr(n[:MAX_NAME_LENGTH]) for n in sorted(names)[:MAX_NAMES_LOGGED]]
    more = len(names) - len(shown)
    return "{" + ", ".join(shown) + (f", ... {more} more" if more else "") + "}"
