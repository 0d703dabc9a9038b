"""Chat fine-tuning data: OpenAI's fine-tuning JSONL, checked line by line and rendered with the
served model's own chat template into token ids and the positions the loss counts.

One JSON object a line:

    {"messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."},
                  {"role": "assistant", "content": "...", "weight": 1}],
     "tools": [...]}                                                    (optional)

Roles: system (or developer), user, assistant and tool. An assistant message has content, or
`tool_calls` (OpenAI's: id, type "function", function.name and function.arguments as JSON text),
or both; a tool message answers a call with `tool_call_id`; `weight` (0 or 1, default 1, on
assistant messages only) says whether the loss counts the message. Every example needs an
assistant message of weight 1.

`check_chat_file(path or lines)` reads and checks a file and returns its `ChatExample`s, or raises
one `ChatDataError` whose `errors` name every bad line ("line 3: messages[1]: unknown role
'robot' ..."). Given a `ChatRenderer` it also renders each example as the server prompts with it
(the messages made into template input by `server.chat.tools.prompt.chat_messages`, the template
`server.chat.templates.load_chat_format` picks, the tokens `server.validation` encodes), and
refuses an example longer than `max_tokens`.

What the loss counts: for each assistant message of weight 1, the tokens between the prompt that
asks for it (the conversation before it rendered with `add_generation_prompt=True`: what the
server prompts with) and the conversation rendered up to and including it, so its end-of-turn
token (`<|im_end|>`, `<|eot_id|>` ...) is counted. The plain "Role: content" template ends a turn
with its stop string instead ("\\nUser:", where the server stops): that is counted too, and
appended after a conversation that ends with an assistant message. A template for which these
renderings are not prefixes of the whole conversation (text or tokens), e.g. one that renders
earlier turns differently, is refused for that example.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gptserve.model.tokenizers import Tokenizer
from gptserve.server.chat.templates import ChatFormat, ChatTemplateError, JinjaChat
from gptserve.server.chat.tools.formats import HERMES, ToolCallFormat, format_for_template
from gptserve.server.chat.tools.prompt import chat_messages
from gptserve.server.chat.tools.request import ToolRequest, read_tools
from gptserve.server.errors import APIError
from gptserve.server.protocol import ChatCompletionRequest
from pydantic import ValidationError

IGNORE_INDEX = -1  # a target the loss skips (GPT.loss's ignore_index)
ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_ERRORS_SHOWN = 10  # in the message of a ChatDataError; `errors` holds them all


class ChatDataError(ValueError):
    """A chat data file that cannot be trained on; `errors` holds one "line N: ..." per bad
    line (or one error about the whole file)."""

    def __init__(self, errors: list[str], source: str | None = None) -> None:
        self.errors = errors
        shown = "; ".join(errors[:MAX_ERRORS_SHOWN])
        more = len(errors) - MAX_ERRORS_SHOWN
        if more > 0:
            shown += f" (and {more} more)"
        head = f"{source}: " if source else ""
        count = f"{len(errors)} bad lines: " if len(errors) > 1 else ""
        super().__init__(f"{head}{count}{shown}")


@dataclass
class ChatExample:
    """One checked line: its messages and tools as given (the messages' `weight` taken out into
    `weights`: 1 or 0 for each assistant message, 0 for every other); with a renderer, also its
    tokens and the [start, end) token ranges the loss counts."""

    line: int
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    weights: list[int]
    request: ChatCompletionRequest = field(repr=False)
    tokens: list[int] | None = None
    spans: list[tuple[int, int]] | None = None

    def inputs_and_targets(self) -> tuple[list[int], list[int]]:
        """The rendered example as a training row: inputs tokens[:-1], and targets tokens[1:]
        where the loss counts them, IGNORE_INDEX elsewhere."""
        assert self.tokens is not None and self.spans is not None
        targets = [IGNORE_INDEX] * (len(self.tokens) - 1)
        for start, end in self.spans:
            for i in range(max(start, 1), end):  # token i is predicted at position i - 1
                targets[i - 1] = self.tokens[i]
        return self.tokens[:-1], targets


def check_chat_file(
    source: str | Path | Iterable[str],
    renderer: ChatRenderer | None = None,
    max_tokens: int | None = None,
) -> list[ChatExample]:
    """The examples of a chat JSONL file (a path) or of its lines (any iterable of strings),
    checked; with a renderer, rendered into tokens too, each at most max_tokens long. Blank lines
    are skipped. Raises ChatDataError naming every bad line."""
    name = str(source) if isinstance(source, (str, Path)) else None
    lines = _lines(Path(source)) if isinstance(source, (str, Path)) else source
    examples, errors = [], []
    for number, line in enumerate(lines, start=1):
        if isinstance(line, bytes):
            try:
                line = line.decode("utf-8")
            except UnicodeDecodeError as exc:
                errors.append(f"line {number}: not UTF-8 text ({exc.reason} at byte {exc.start})")
                continue
        if not line.strip():
            continue
        try:
            example = read_example(line, number)
            if renderer is not None:
                renderer.render(example, max_tokens)
        except ChatDataError as exc:
            errors.extend(exc.errors)
            continue
        examples.append(example)
    if errors:
        raise ChatDataError(errors, name)
    if not examples:
        raise ChatDataError(["no examples (every line is blank)"], name)
    return examples


def _lines(path: Path) -> list[bytes]:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ChatDataError([f"cannot read it: {exc.strerror or exc}"], str(path)) from None
    return data.split(b"\n")


def read_example(line: str, number: int = 1) -> ChatExample:
    """One JSONL line as a ChatExample, checked (not rendered); ChatDataError("line N: ...")."""

    def bad(message: str) -> ChatDataError:
        return ChatDataError([f"line {number}: {message}"])

    try:
        obj = json.loads(line)
    except ValueError as exc:
        raise bad(f"not JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise bad(f"not a JSON object but {type(obj).__name__}")
    messages = obj.get("messages")
    if not messages:
        raise bad('no messages (each line needs "messages": a list of messages)')
    if not isinstance(messages, list):
        raise bad(f"messages must be a list, not {type(messages).__name__}")
    given, weights = [], []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad(f"{where} is not an object")
        role = message.get("role")
        if role not in ROLES:
            shown = "no role" if role is None else f"unknown role {role!r}"
            raise bad(f"{where}: {shown} (one of {', '.join(ROLES)})")
        content = message.get("content")
        if content is not None and not _is_content(content):
            raise bad(f"{where}.content must be a string or a list of text parts")
        if role == "assistant":
            if not content and not message.get("tool_calls"):
                raise bad(f"{where}: an assistant message needs content or tool_calls")
            weight = message.get("weight", 1)
            if isinstance(weight, bool) or weight not in (0, 1):
                raise bad(f"{where}.weight must be 0 or 1, got {json.dumps(weight)}")
            weights.append(int(weight))
        else:
            if "weight" in message:
                raise bad(f"{where}.weight: only assistant messages have a weight")
            if content is None:
                raise bad(f"{where}: a {role} message needs content")
            weights.append(0)
        given.append({k: v for k, v in message.items() if k != "weight"})
    if 1 not in weights:
        raise bad("no assistant message with weight 1: nothing to train on")
    tools = obj.get("tools")
    body = {"messages": given}
    if tools is not None:
        body["tools"] = tools
    if obj.get("parallel_tool_calls") is not None:
        body["parallel_tool_calls"] = obj["parallel_tool_calls"]
    try:
        request = ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise bad(_pydantic_error(exc, given)) from None
    try:  # the server's checks of calls and results (ids, JSON arguments, tool_call_id)
        chat_messages(request.messages, None, HERMES, knows_tools=True)
    except APIError as exc:
        raise bad(exc.message) from None
    return ChatExample(number, given, tools, weights, request)


def _is_content(content: Any) -> bool:
    if isinstance(content, str):
        return True
    return isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    )


def _pydantic_error(exc: ValidationError, messages: Sequence[dict[str, Any]]) -> str:
    """The first error as "messages[1].tool_calls[0].function.arguments: Input should be ..."."""
    error = exc.errors()[0]
    parts: list[str] = []
    loc = list(error["loc"])
    for j, key in enumerate(loc):
        if isinstance(key, int):
            parts.append(f"[{key}]")
        elif j == 2 and loc[0] == "messages":  # the role the union picked
            continue
        else:
            parts.append(("." if parts else "") + str(key))
    return f"{''.join(parts)}: {error['msg']}"


class ChatRenderer:
    """Examples -> the tokens the server would prompt with, and the spans the loss counts.

    `template` is the served model's chat format (`load_chat_format`), `tokenizer` its tokenizer;
    `tool_format` how its calls are written (default: as the server picks it for the template).
    """

    def __init__(
        self,
        template: ChatFormat,
        tokenizer: Tokenizer,
        tool_format: ToolCallFormat | None = None,
        vocab_size: int | None = None,
    ) -> None:
        self.template = template
        self.tokenizer = tokenizer
        self.tool_format = tool_format or format_for_template(template)
        self.vocab_size = vocab_size
        self.allow_special = True if template.specials_in_prompt else None  # as the server
        self._tools: dict[str, ToolRequest | None] = {}  # checked tools by their JSON

    def render(self, example: ChatExample, max_tokens: int | None = None) -> ChatExample:
        """Fill in example.tokens and example.spans; ChatDataError("line N: ...")."""

        def bad(message: str) -> ChatDataError:
            return ChatDataError([f"line {example.line}: {message}"])

        try:
            tools = self._read_tools(example)
            items, shown = chat_messages(
                example.request.messages, tools, self.tool_format, self.template.knows_tools
            )
        except APIError as exc:
            raise bad(exc.message) from None
        added = len(items) - len(example.messages)  # a system turn describing the tools
        try:
            full = self._text(items, shown, generation_prompt=False)
            stop = self.template.stop[0] if self.template.stop else ""
            if stop and example.messages[-1]["role"] == "assistant":
                full += stop[_overlap(full, stop) :]  # the turn ends where the server stops it
            tokens = self._encode(full)
            spans = []
            for i, weight in enumerate(example.weights):
                if weight:
                    where = f"messages[{i}]"
                    spans.append(
                        self._span(items, shown, i + added, where, full, tokens, stop, bad)
                    )
        except ChatTemplateError as exc:
            raise bad(f"the chat template failed: {exc}") from None
        if max_tokens is not None and len(tokens) > max_tokens:
            raise bad(
                f"the example is {len(tokens)} tokens, longer than the context ({max_tokens}); "
                "shorten or split it"
            )
        example.tokens, example.spans = tokens, spans
        return example

    def _span(
        self, items: list[dict[str, Any]], shown: list[dict[str, Any]] | None, j: int, where: str,
        full: str, tokens: list[int], stop: str, bad: Callable[[str], ChatDataError],
    ) -> tuple[int, int]:  # fmt: skip
        """Token range of assistant message j (of the template's items): from the end of the
        prompt that asks for it to the end of its rendering (and the plain template's stop)."""
        prompt = self._text(items[:j], shown, generation_prompt=True)
        upto = self._text(items[: j + 1], shown, generation_prompt=False)
        if not upto.startswith(prompt) or not full.startswith(upto):
            raise bad(
                f"{where}: the chat template does not render this conversation turn by turn "
                "(the prompt for this assistant message, or the conversation up to it, is not "
                "how the whole conversation begins); it cannot be trained on as one example: "
                "end the example at this message"
            )
        end = len(upto)
        if stop:
            k = _overlap(upto, stop)
            if full.startswith(stop, end - k):
                end += len(stop) - k
        starts, ends = self._encode(prompt), self._encode(full[:end])
        if tokens[: len(starts)] != starts or tokens[: len(ends)] != ends:
            raise bad(
                f"{where}: the tokens of the prompt for this assistant message, or of its end, "
                "are not how the whole conversation's tokens begin (the tokenizer merges text "
                "across the turn boundary); change how the message starts or ends"
            )
        return len(starts), len(ends)

    def _read_tools(self, example: ChatExample) -> ToolRequest | None:
        if not example.tools:
            return None
        key = json.dumps(example.tools, sort_keys=True) + str(example.request.parallel_tool_calls)
        if key not in self._tools:
            self._tools[key] = read_tools(example.request, self.tokenizer, self.vocab_size)
        return self._tools[key]

    def _text(
        self, items: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
        generation_prompt: bool,
    ) -> str:  # fmt: skip
        if isinstance(self.template, JinjaChat):
            return self.template.template.render(
                items, add_generation_prompt=generation_prompt, tools=tools
            )
        text = self.template.render_messages(items, tools)  # ends with the generation prefix
        return text if generation_prompt else text[: len(text) - len(self.template.prefix)]

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, self.allow_special) if text else []


def _overlap(text: str, stop: str) -> int:
    """The length of the longest end of `text` that begins `stop`."""
    for k in range(min(len(text), len(stop)), 0, -1):
        if text.endswith(stop[:k]):
            return k
    return 0


def split_examples(
    examples: list[ChatExample], val_fraction: float
) -> tuple[list[ChatExample], list[ChatExample]]:
    """The last val_fraction of the examples (at least one when the fraction is not 0) is the
    validation split; at least one example stays for training."""
    if val_fraction <= 0:
        return examples, []
    n_val = math.ceil(len(examples) * val_fraction)
    if len(examples) - n_val < 1:
        raise ChatDataError(
            [
                f"{len(examples)} example(s), too few for --val-fraction {val_fraction}: give "
                "more examples, a --val-data file, or --val-fraction 0"
            ]
        )
    return examples[: len(examples) - n_val], examples[len(examples) - n_val :]
