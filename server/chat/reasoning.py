"""Reasoning models: their thinking apart from their answer, as vLLM's reasoning parsers split it.

Qwen3 writes `<think>\\n...\\n</think>\\n\\n` before its answer, unless the chat template's
`enable_thinking=false` put an empty block in the prompt (it then answers at once); DeepSeek-R1's
template opens the block in the prompt, so its output is `...</think>answer`. A `ReasoningSplitter`
cuts a choice's text into `reasoning_content` and `content` as it streams (a tag split across
chunks is held back until it is whole), and `split` does the same for a whole answer, so the two
agree. The newlines between `</think>` and the answer belong to neither.

`--reasoning-parser qwen3|deepseek_r1` names the format; without it the chat template tells
(`default_format`). A structured output or tool-call grammar then constrains only what follows
`</think>` (`engine.grammar.AfterToken`): the thinking itself is free.
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningFormat:
    """How a model writes its reasoning: `name` (vLLM's parser name) and whether the answer's
    text opens the block itself (Qwen3) or the prompt already did (DeepSeek-R1)."""

    name: str
    opens_in_output: bool


FORMATS = {
    "qwen3": ReasoningFormat("qwen3", opens_in_output=True),
    "deepseek_r1": ReasoningFormat("deepseek_r1", opens_in_output=False),
}
PARSER_NAMES = tuple(FORMATS)


def default_format(template_source: str | None) -> ReasoningFormat | None:
    """The format a chat template implies: Qwen3's switches thinking with `enable_thinking`;
    one that writes `<think>` into the generation prompt is DeepSeek-R1's; else None."""
    if not template_source or THINK_OPEN not in template_source:
        return None
    if "enable_thinking" in template_source:
        return FORMATS["qwen3"]
    return FORMATS["deepseek_r1"]


class ReasoningSplitter:
    """One choice's text, fed as it comes, split into (reasoning, content) pieces."""

    def __init__(self, fmt: ReasoningFormat) -> None:
        self.fmt = fmt
        self._state = "start"  # start -> reasoning -> after -> content
        self._held = ""
        self.thought = not fmt.opens_in_output  # whether the text has a reasoning block

    def feed(self, text: str) -> tuple[str, str]:
        """The reasoning and content that `text` releases (a possible tag's start is held)."""
        reasoning, content = "", ""
        self._held += text
        while self._held:
            if self._state == "start":
                head = self._held.lstrip()
                if head.startswith(THINK_OPEN):
                    self._held, self._state = head[len(THINK_OPEN) :], "reasoning"
                    self.thought = True
                elif THINK_OPEN.startswith(head):
                    break  # "<thi": it may still open the block
                else:
                    self._state = "reasoning" if not self.fmt.opens_in_output else "content"
            elif self._state == "reasoning":
                end = self._held.find(THINK_CLOSE)
                if end >= 0:
                    reasoning += self._held[:end]
                    self._held, self._state = self._held[end + len(THINK_CLOSE) :], "after"
                    continue
                keep = _partial_suffix(self._held, THINK_CLOSE)
                reasoning += self._held[: len(self._held) - keep]
                self._held = self._held[len(self._held) - keep :]
                break
            elif self._state == "after":
                rest = self._held.lstrip("\n")
                self._held = rest
                if rest:
                    self._state = "content"
            else:
                content += self._held
                self._held = ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is still held when the text ends: a tag's start that never completed is text."""
        held, self._held = self._held, ""
        if self._state == "reasoning":
            return held, ""
        if self._state == "start" and not self.fmt.opens_in_output:
            return held, ""
        return "", held if self._state != "after" else ""


def split(fmt: ReasoningFormat, text: str) -> tuple[str | None, str]:
    """A whole answer's (reasoning_content or None, content)."""
    splitter = ReasoningSplitter(fmt)
    reasoning, content = splitter.feed(text)
    more_reasoning, more_content = splitter.finish()
    reasoning, content = reasoning + more_reasoning, content + more_content
    return (reasoning if splitter.thought else None), content


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (0: none)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
