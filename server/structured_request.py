"""The structured-output fields of a request -> the one constraint it asks for, compiled.

A request may ask in several ways: OpenAI's `response_format` (`json_object`, or `json_schema`
with its `{"name", "schema", "strict"}` wrapper), vLLM's `structured_outputs` (`json`, `regex`,
`choice`, `grammar`, `json_object`), vLLM's older top-level `guided_json`, `guided_regex`,
`guided_choice` and `guided_grammar`, and llama.cpp's server's `grammar`. This module reads those
fields, refuses what this server cannot build, allows at most one, and hands `engine.grammar` an
already-decided spec (a JSON schema, a regular expression, a list of choices, or a grammar in
llguidance's Lark syntax: a GBNF grammar is converted, a Lark one taken as it is). Every error names the request field at fault
(`RequestError.param`); `server.validation` answers it with a 400.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from gptserve.engine.errors import RequestError
from gptserve.engine.grammar import (
    JSON_OBJECT_SCHEMA,
    Constraint,
    ConstraintKind,
    GrammarError,
    compile_constraint,
)
from gptserve.engine.grammar_bounds import TooCostly, check_gbnf
from gptserve.engine.sequence import GRAMMAR_ERROR
from gptserve.model.tokenizers import Tokenizer
from gptserve.server.protocol import StructuredFields, StructuredOutputs
from llguidance.gbnf_to_lark import any_to_lark

# how a request asked: the wrapper it came in decides how its value is read
RequestKind = Literal["json_object", "json_schema", "json", "regex", "choice", "grammar"]
# older vLLM's top-level fields, each the same as a key of structured_outputs
GUIDED_FIELDS: tuple[tuple[str, RequestKind], ...] = (
    ("guided_json", "json"),
    ("guided_regex", "regex"),
    ("guided_choice", "choice"),
    ("guided_grammar", "grammar"),
    ("grammar", "grammar"),  # llama.cpp's server's field
)
MAX_GRAMMAR_CHARS = (
    100_000  # a grammar's text; its cost is bounded as a regex's is (engine.grammar)
)
# structured_outputs keys that ask for a constraint this server cannot build
UNSUPPORTED_STRUCTURED = {
    "structural_tag": "structural tags are not supported; use json, regex or choice",
    "whitespace_pattern": "whitespace_pattern is not supported: JSON is written without whitespace",
}
SCHEMA_NAME = re.compile(r"[\w-]{1,64}")  # OpenAI's rule for json_schema.name


@dataclass(frozen=True)
class StructuredAsk:
    """One constraint field of a request, read but not compiled."""

    param: str  # the request field named in errors
    where: str  # the field's path in messages ("response_format.json_schema")
    kind: RequestKind
    value: Any  # as the request sent it

    def spec(self) -> tuple[ConstraintKind, object]:
        """The grammar engine's kind and spec for this field's value."""
        if self.kind == "json_object":
            return "json", JSON_OBJECT_SCHEMA
        if self.kind == "json_schema":
            return "json", self._schema_in_wrapper()
        if self.kind == "grammar":
            return "lark", self._grammar_as_lark()
        if self.kind == "json" and isinstance(self.value, str):  # a schema sent as JSON text
            try:
                return "json", json.loads(self.value)
            except ValueError as exc:
                raise self.error(f"the schema is not JSON: {exc}") from None
        return self.kind, self.value

    def _grammar_as_lark(self) -> str:
        """A grammar as users write them: GBNF (llama.cpp's, `root ::= ...`; vLLM's EBNF is the
        same) becomes llguidance's Lark; Lark (`start: ...`) stays as it is."""
        text = self.value
        if not isinstance(text, str) or not text.strip():
            raise self.error("must be a non-empty string (a GBNF or Lark grammar)")
        if len(text) > MAX_GRAMMAR_CHARS:
            raise self.error(f"longer than {MAX_GRAMMAR_CHARS} characters", GRAMMAR_ERROR)
        try:
            if "::=" in text:  # GBNF: bounded before its conversion, which is quadratic in rules
                check_gbnf(text)
        except TooCostly as exc:
            raise self.error(f"too costly to compile: {exc}", GRAMMAR_ERROR) from None
        try:
            return any_to_lark(text)
        except Exception as exc:  # noqa: BLE001 - GbnfToLarkError, and a bare Exception for a rule it cannot find
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else "invalid"
            raise self.error(f"the grammar does not parse: {first}") from None

    def _schema_in_wrapper(self) -> object:
        """OpenAI's `json_schema` object -> its schema. The schema is always enforced; `strict`
        is accepted and changes nothing."""
        wrapper = self.value
        if not isinstance(wrapper, dict):
            raise self.error("json_schema must be an object with 'name' and 'schema'")
        name = wrapper.get("name")
        if name is not None and not (isinstance(name, str) and SCHEMA_NAME.fullmatch(name)):
            raise self.error("json_schema.name must be 1-64 letters, digits, _ or -")
        strict = wrapper.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise self.error("json_schema.strict must be a boolean")
        if "schema" not in wrapper:
            raise self.error("json_schema.schema is required")
        return wrapper["schema"]

    def compile(self, tokenizer: Tokenizer, vocab_size: int | None = None) -> Constraint:
        kind, spec = self.spec()
        try:
            return compile_constraint(kind, spec, tokenizer, vocab_size=vocab_size)
        except GrammarError as exc:
            raise self.error(exc.message, exc.code) from None

    def error(self, message: str, code: str | None = None) -> RequestError:
        return RequestError(f"{self.where}: {message}", self.param, code)


@dataclass(frozen=True)
class RequestedConstraint:
    """The constraint a request asked for, compiled: one sequence's (`fork()` it for more)."""

    kind: RequestKind
    param: str
    constraint: Constraint


def constraint_from_fields(
    fields: StructuredFields, tokenizer: Tokenizer, vocab_size: int | None = None
) -> RequestedConstraint | None:
    """The constraint a parsed request body asks for, or None; raises RequestError."""
    asks: list[StructuredAsk] = []
    response_format = fields.response_format
    if response_format is not None and response_format.type == "json_object":
        asks.append(StructuredAsk("response_format", "response_format", "json_object", None))
    elif response_format is not None and response_format.type == "json_schema":
        given = response_format.json_schema
        wrapper = given and given.model_dump(by_alias=True, exclude_none=True)
        where = "response_format.json_schema"
        asks.append(StructuredAsk("response_format", where, "json_schema", wrapper))
    if fields.structured_outputs is not None:
        asks.extend(_structured_outputs(fields.structured_outputs))
    for param, kind in GUIDED_FIELDS:
        if getattr(fields, param) is not None:
            asks.append(StructuredAsk(param, param, kind, getattr(fields, param)))
    return _compile_one(asks, tokenizer, vocab_size)


def constraint_from_request(
    tokenizer: Tokenizer,
    *,
    response_format: dict[str, Any] | None = None,
    guided_json: object = None,
    guided_regex: str | None = None,
    guided_choice: Sequence[str] | None = None,
    vocab_size: int | None = None,
) -> RequestedConstraint | None:
    """The same for a body's fields as plain JSON values (no pydantic model in between)."""
    asks: list[StructuredAsk] = []
    if response_format is not None:
        rf_type = response_format.get("type") if isinstance(response_format, dict) else None
        if rf_type == "json_schema":
            wrapper = response_format.get("json_schema")
            asks.append(
                StructuredAsk("response_format", "response_format.json_schema", "json_schema",
                              wrapper)
            )  # fmt: skip
        elif rf_type == "json_object":
            asks.append(StructuredAsk("response_format", "response_format", "json_object", None))
        elif rf_type != "text":
            raise RequestError(
                "response_format must be an object whose type is text, json_object or json_schema",
                "response_format",
            )
    guided = {"guided_json": guided_json, "guided_regex": guided_regex,
              "guided_choice": guided_choice}  # fmt: skip
    for param, kind in GUIDED_FIELDS:
        if guided.get(param) is not None:
            asks.append(StructuredAsk(param, param, kind, guided[param]))
    return _compile_one(asks, tokenizer, vocab_size)


def _structured_outputs(structured: StructuredOutputs) -> list[StructuredAsk]:
    param = "structured_outputs"
    for key, message in UNSUPPORTED_STRUCTURED.items():
        if getattr(structured, key) is not None:
            raise RequestError(f"structured_outputs.{key}: {message}", param)
    if structured.disable_additional_properties:
        raise RequestError(
            "structured_outputs.disable_additional_properties is not supported; "
            "set additionalProperties: false in the schema",
            param,
        )
    asks: list[StructuredAsk] = []
    if structured.json_ is not None:
        asks.append(StructuredAsk(param, "structured_outputs.json", "json", structured.json_))
    if structured.regex is not None:
        asks.append(StructuredAsk(param, "structured_outputs.regex", "regex", structured.regex))
    if structured.choice is not None:
        asks.append(StructuredAsk(param, "structured_outputs.choice", "choice", structured.choice))
    if structured.grammar is not None:
        where = "structured_outputs.grammar"
        asks.append(StructuredAsk(param, where, "grammar", structured.grammar))
    if structured.json_object:
        asks.append(StructuredAsk(param, "structured_outputs.json_object", "json_object", None))
    if not asks:
        raise RequestError(
            "structured_outputs needs one of json, regex, choice, grammar or json_object", param
        )
    return asks


def _compile_one(
    asks: list[StructuredAsk], tokenizer: Tokenizer, vocab_size: int | None
) -> RequestedConstraint | None:
    """At most one constraint per request, compiled."""
    if not asks:
        return None
    if len(asks) > 1:
        names = " and ".join(ask.where for ask in asks[:2])
        raise RequestError(
            f"at most one structured-output constraint per request; got {names}", asks[1].param
        )
    ask = asks[0]
    return RequestedConstraint(ask.kind, ask.param, ask.compile(tokenizer, vocab_size))
