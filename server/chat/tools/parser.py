"""A completion's text read back as OpenAI's assistant message: content and tool calls.

`ToolCallParser` takes the text as it is released (a stream's pieces, or the whole text at once)
and hands out deltas in OpenAI's streaming shape: content, and per call a first item with its
id, type and name, then pieces of its arguments. The whole message is the sum of those deltas,
so a streamed answer and a whole one agree to the character, and a call's arguments are the very
text the model wrote (not re-serialized).

Whitespace around a call is not content; the text of an answer with
no calls is returned exactly as written. A call cut short (by `max_tokens` or a stop string) keeps
what was written of its arguments, and the choice keeps its own finish reason (`length`); a call
cut short before its name was complete is left out, and so is the start of one after whole calls
(only calls may follow calls).

A call that repeats an earlier call of the same answer (the same name, arguments equal as parsed
JSON) ends the answer: it is left out, nothing after it is read, and the finish reason is
`tool_calls` (`repeated`; the server then stops the sequence, `server.openai_api`). A small model
under `tool_choice: "required"` with parallel calls otherwise writes its one call again and
again until `max_tokens`. So that a stream never hands out a call it must take back, a call
named like an earlier one is held back until its arguments are whole; any other streams at once.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from gptserve.server.chat.tools.formats import ToolCallFormat

_WHITESPACE = " \t\r\n"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ParsedCall:
    id: str
    name: str
    arguments: list[str] = field(default_factory=list)
    complete: bool = False

    def as_dict(self) -> dict[str, Any]:
        arguments = "".join(self.arguments)
        return {"id": self.id, "type": "function", "function": {"name": self.name,
                                                               "arguments": arguments}}  # fmt: skip

    def key(self) -> tuple[str, Any]:
        """What makes two calls the same: the name, and the arguments as parsed JSON (as
        written, less surrounding whitespace, where they do not parse)."""
        text = "".join(self.arguments).strip()
        try:
            return self.name, ("json", json.loads(text))
        except ValueError:
            return self.name, ("text", text)


@dataclass
class MessageDelta:
    """What one piece of text released: content and OpenAI `delta.tool_calls` items."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)

    def add_arguments(self, index: int, text: str) -> None:
        """Arguments for call `index`, joined to its last item when that is the same call."""
        if not text:
            return
        last = self.tool_calls[-1] if self.tool_calls else None
        if last is not None and last["index"] == index:
            last["function"]["arguments"] += text
        else:
            self.tool_calls.append({"index": index, "function": {"arguments": text}})


class ToolCallParser:
    """Splits one completion's text into content and calls written in `fmt`."""

    def __init__(self, fmt: ToolCallFormat) -> None:
        self.fmt = fmt
        self.calls: list[ParsedCall] = []
        self._content: list[str] = []
        self._buffer = ""  # text read but not yet handed out
        self._after_call = False  # whitespace here only separates text from the call before
        # "text": free text that a trigger may end (hermes); "start": before the first character
        # (llama3_json: "{" begins a call); "plain": text to the end; "head", "args", "tail": a
        # call's parts; "between": after a call (llama3_json: a separator or the end); "done":
        # after a repeated call, the end
        self._state = "text" if fmt.opening else "start"
        self._trigger = fmt.opening.rstrip()
        self._tail = fmt.closing.strip() or "}"
        head = r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"' + re.escape(fmt.args_key)
        self._head = re.compile(head + r'"\s*:\s*')
        self._depth = 0
        self._in_string = self._escaped = self._args_started = False
        self._scalar = ""  # "string" or "bare" while the arguments are not an object or array
        # the deltas of a call named like an earlier one, held until its arguments are whole
        self._held: MessageDelta | None = None
        self.repeated = False  # a call repeated an earlier one: the answer ended before it

    # ---- results -------------------------------------------------------------------------

    @property
    def content(self) -> str | None:
        """The message's content: None when it made calls and wrote nothing else."""
        text = "".join(self._content)
        return None if self.calls and not text else text

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """The choice ended after whole calls, or at a repeated call (whatever the engine says,
        even before it says it): "tool_calls"; else the engine's reason."""
        if self.repeated:
            return "tool_calls"
        whole = self.calls and all(call.complete for call in self.calls)
        return "tool_calls" if engine_reason == "stop" and whole else engine_reason

    def message(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.calls:
            out["tool_calls"] = [call.as_dict() for call in self.calls]
        return out

    # ---- reading -------------------------------------------------------------------------

    def feed(self, text: str, last: bool = False) -> MessageDelta:
        """Read the next piece of the completion's text; `last`: the completion ends with it,
        so what was held back is handed out too."""
        self._buffer += text
        delta = MessageDelta()
        while self._step(delta):
            pass
        if last:
            self._finish(delta)
        return delta

    def stream_delta(
        self, text: str, engine_reason: str | None
    ) -> tuple[dict[str, Any], str | None]:
        """A stream chunk's `delta` for the next piece of text and, on the last piece (the
        engine's finish reason set), the choice's finish reason."""
        piece = self.feed(text, last=engine_reason is not None)
        delta: dict[str, Any] = {}
        if piece.content:
            delta["content"] = piece.content
        if piece.tool_calls:
            delta["tool_calls"] = piece.tool_calls
        return delta, self.finish_reason(engine_reason)

    def _finish(self, delta: MessageDelta) -> None:
        rest, self._buffer = self._buffer, ""
        if self._held is not None:  # a call cut short before it was known to repeat: as it is
            delta.tool_calls.extend(self._held.tool_calls)
            self._held = None
        if self._state in ("start", "plain") or (self._state == "text" and not self.calls):
            self._emit(delta, rest)  # text held back in case a call began: there was none

    def parse_all(self, text: str) -> dict[str, Any]:
        """The whole text -> the assistant message."""
        self.feed(text, last=True)
        return self.message()

    def _emit(self, delta: MessageDelta, text: str) -> None:
        if text:
            self._content.append(text)
            delta.content += text

    def _step(self, delta: MessageDelta) -> bool:
        """Advance through the buffer once; False when it needs more text."""
        state = self._state
        if state == "done":  # after a repeated call: nothing more is read
            self._buffer = ""
            return False
        if state == "text":
            return self._text(delta)
        if state == "start":
            if not self._buffer:
                return False
            self._state = "head" if self._buffer[0] == "{" else "plain"
            return True
        if state == "plain":
            self._emit(delta, self._buffer)
            self._buffer = ""
            return False
        if state == "head":
            return self._call_head(delta)
        if state == "args":
            return self._arguments(delta)
        if state == "tail":
            at = self._buffer.find(self._tail)
            if at < 0:
                return False
            self._buffer = self._buffer[at + len(self._tail) :]
            self.calls[-1].complete = True
            self._state = "text" if self.fmt.opening else "between"
            self._after_call = True
            return True
        # between (llama3_json): a separator and the next call, or the end
        rest = self._buffer.lstrip(_WHITESPACE + self.fmt.separator.strip())
        if not rest:
            return False
        self._buffer, self._state = rest, ("head" if rest[0] == "{" else "plain")
        return True

    def _text(self, delta: MessageDelta) -> bool:
        buffer = self._buffer
        at = buffer.find(self._trigger)
        if at >= 0:  # a call begins: the whitespace before it is not content
            self._emit(delta, buffer[:at].rstrip(_WHITESPACE))
            self._buffer = buffer[at + len(self._trigger) :]
            self._state = "head"
            return True
        # hold back what may begin the trigger, and whitespace that may come before a call
        keep = next(
            (n for n in range(min(len(self._trigger) - 1, len(buffer)), 0, -1)
             if self._trigger.startswith(buffer[-n:])),
            0,
        )  # fmt: skip
        ready = buffer[: len(buffer) - keep]
        stripped = ready.rstrip(_WHITESPACE)
        self._buffer = buffer[len(stripped) :]
        if self._after_call:
            stripped = stripped.lstrip(_WHITESPACE)
            self._after_call = not stripped
        self._emit(delta, stripped)
        return False

    def _call_head(self, delta: MessageDelta) -> bool:
        match = self._head.match(self._buffer)
        if match is None:
            return False
        name = json.loads(f'"{match.group(1)}"')
        if any(call.name == name for call in self.calls):  # it may repeat one: held back
            delta = self._held = MessageDelta()
        self.calls.append(ParsedCall(new_call_id(), name))
        index = len(self.calls) - 1
        delta.tool_calls.append({
            "index": index, "id": self.calls[-1].id, "type": "function",
            "function": {"name": name, "arguments": ""},
        })  # fmt: skip
        self._buffer = self._buffer[match.end() :]
        self._state = "args"
        self._depth, self._scalar = 0, ""
        self._in_string = self._escaped = self._args_started = False
        return True

    def _arguments(self, delta: MessageDelta) -> bool:
        """Hand out the arguments' JSON as it comes, up to the end of its value."""
        buffer, end = self._buffer, None
        for i, char in enumerate(buffer):
            if not self._args_started:
                if char in _WHITESPACE:
                    continue
                self._args_started = True
                if char in "{[":
                    self._depth = 1
                elif char == '"':
                    self._scalar, self._in_string = "string", True
                else:
                    self._scalar = "bare"
                continue
            if self._scalar == "bare":
                if char in ",}]" or char in _WHITESPACE:
                    end = i
                    break
            elif self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
                    if self._scalar == "string":
                        end = i + 1
                        break
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    end = i + 1
                    break
        piece = buffer if end is None else buffer[:end]
        call = self.calls[-1]
        text = piece.lstrip(_WHITESPACE) if not call.arguments else piece
        if text:
            call.arguments.append(text)
            held = self._held if self._held is not None else delta
            held.add_arguments(len(self.calls) - 1, text)
        if end is None:
            self._buffer = ""
            return False
        self._buffer, self._state = buffer[end:], "tail"
        if self._held is not None:  # the arguments are whole: a repeat, or a call to hand out
            held, self._held = self._held, None
            if any(call.key() == earlier.key() for earlier in self.calls[:-1]):
                self.calls.pop()
                self.repeated, self._state, self._buffer = True, "done", ""
                return False
            delta.tool_calls.extend(held.tool_calls)
        return True
