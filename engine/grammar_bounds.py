"""What the grammar compiler recurses on, bounded before it runs.

llguidance builds a grammar by recursion in native code: a chain of rules that each name the
next (`r0: r1`, `r1: r2`, ...) or of JSON schema `$ref`s goes one native stack frame a link
deeper, and about 2,500 links overflow an 8 MB stack: the process dies with SIGSEGV, no error,
no log line. So a grammar's shape is measured here first, in Python and without recursion, and
one past these bounds is refused as too costly (the request's error names its field):

- a Lark or GBNF grammar: at most MAX_RULES rule and terminal definitions, at most
  MAX_RULE_DEPTH definitions on one path of references from the start (each followed once),
  and repetition counts (`{n}`, `{m,n}`) multiplying to at most MAX_EXPANSION along one path
  (a regex's counted repetitions are bounded by the lexer's fuel instead, engine.grammar);
- a JSON schema: at most MAX_SCHEMA_DEPTH objects and arrays nested, and at most
  MAX_REF_DEPTH `$ref`s followed one after another.

engine.grammar also compiles on a thread with a COMPILE_STACK_BYTES stack (about 40x what
these bounds need, measured), so what slips past them still cannot reach the stack's end.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

MAX_RULES = 2_000
MAX_RULE_DEPTH = 1_000
MAX_SCHEMA_DEPTH = 64
MAX_REF_DEPTH = 256
MAX_EXPANSION = 100_000  # repetition counts multiplied along a path of rules
COMPILE_STACK_BYTES = 256 << 20  # reserved address space; pages are used only as touched

_LARK_RULE = re.compile(r"^[ \t]*[?!]?([A-Za-z_]\w*)(?:\.-?\d+)?[ \t]*:(?!:)", re.MULTILINE)
_GBNF_RULE = re.compile(r"^[ \t]*([A-Za-z_][\w-]*)[ \t]*::=", re.MULTILINE)
# literals, whose words are not references: "..." strings, /.../ regexes, [...] classes
_LITERALS = re.compile(r'"(?:[^"\\\n]|\\.)*"|/(?:[^/\\\n]|\\.)+/[imslux]*|\[(?:[^\]\\\n]|\\.)*\]')
_NAME = re.compile(r"[A-Za-z_][\w-]*")
_REPEAT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")  # {n}, {m,n}, {m,}


class TooCostly(ValueError):
    """A grammar past a bound; the message is one line."""


def _definitions(text: str, rule: re.Pattern[str]) -> tuple[dict[str, set[str]], dict[str, int]]:
    """Each definition's name -> the names its body mentions (alternatives included), and
    -> the largest count its body repeats something (`x{600}`, `x{2,50}`; 1 for none)."""
    starts = list(rule.finditer(text))
    if len(starts) > MAX_RULES:
        raise TooCostly(f"more than {MAX_RULES} rules")
    names = {m.group(1) for m in starts}
    graph: dict[str, set[str]] = {}
    counts: dict[str, int] = {}
    for m, nxt in zip(starts, [*starts[1:], None]):
        body = _LITERALS.sub(" ", text[m.end() : nxt.start() if nxt else len(text)])
        name = m.group(1)
        graph.setdefault(name, set()).update(set(_NAME.findall(body)) & names)
        repeats = (max(int(lo), int(hi or lo)) for lo, hi in _REPEAT.findall(body))
        counts[name] = max(counts.get(name, 1), *repeats, 1)
    return graph, counts


def _expansion(graph: dict[str, set[str]], counts: dict[str, int], start: str) -> int:
    """An upper bound of how many times repetitions multiply along a path of references from
    `start` (`root ::= ab{600}`, `ab ::= "a"{600}`: 360,000), a reference back up the path
    counted once; computed bottom-up without recursion."""
    if start not in graph:
        return 1
    factor: dict[str, int] = {}
    on_path = {start}
    stack = [(start, iter(graph[start]))]
    while stack:
        name, refs = stack[-1]
        ref = next(refs, None)
        if ref is None:
            below = max((factor.get(r, 1) for r in graph[name] if r not in on_path), default=1)
            factor[name] = min(counts.get(name, 1) * below, MAX_EXPANSION + 1)
            on_path.discard(name)
            stack.pop()
        elif ref not in factor and ref not in on_path:
            on_path.add(ref)
            stack.append((ref, iter(graph.get(ref, ()))))
    return factor[start]


def _reference_depth(graph: dict[str, set[str]], start: str) -> int:
    """The deepest stack of definitions a walk from `start` holds, each definition entered once
    (an explicit stack: no recursion here either)."""
    if start not in graph:
        return 0
    seen = {start}
    stack = [iter(graph[start])]
    deepest = 1
    while stack:
        name = next(stack[-1], None)
        if name is None:
            stack.pop()
        elif name not in seen:
            seen.add(name)
            stack.append(iter(graph.get(name, ())))
            deepest = max(deepest, len(stack))
    return deepest


def _check_shape(text: str, rule: re.Pattern[str], start: str) -> None:
    graph, counts = _definitions(text, rule)
    if _reference_depth(graph, start) > MAX_RULE_DEPTH:
        raise TooCostly(f"rules nest more than {MAX_RULE_DEPTH} deep")
    if _expansion(graph, counts, start) > MAX_EXPANSION:
        raise TooCostly(f"repetitions multiply past {MAX_EXPANSION} along its rules")


def check_gbnf(text: str) -> None:
    """Raise TooCostly for a GBNF grammar (`root ::= ...`) past the bounds."""
    _check_shape(text, _GBNF_RULE, "root")


def check_lark(text: str) -> None:
    """Raise TooCostly for a Lark grammar (`start: ...`) past the bounds."""
    _check_shape(text, _LARK_RULE, "start")


def check_schema(schema: Any) -> None:
    """Raise TooCostly for a JSON schema past the bounds: its nesting, and its deepest path of
    `$ref`s from the schema through its local definitions ("#/$defs/a" -> "#/$defs/b" ...)."""
    _check_nesting(schema)
    if not isinstance(schema, dict):
        return
    sections = {
        key: schema[key] for key in ("$defs", "definitions") if isinstance(schema.get(key), dict)
    }
    graph = {"#": _refs_in({k: v for k, v in schema.items() if k not in sections})}
    for key, defs in sections.items():
        for name, sub in defs.items():
            graph[f"#/{key}/{name}"] = _refs_in(sub)
    if _reference_depth(graph, "#") > MAX_REF_DEPTH:
        raise TooCostly(f"$ref chains longer than {MAX_REF_DEPTH}")


def _check_nesting(schema: Any) -> None:
    if not isinstance(schema, (dict, list)):
        return
    stack = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise TooCostly(f"the schema nests more than {MAX_SCHEMA_DEPTH} deep")
        children = node.values() if isinstance(node, dict) else node
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))


def _refs_in(node: Any) -> set[str]:
    """Every `$ref` string anywhere in `node`."""
    found: set[str] = set()
    stack = [node]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if isinstance(node.get("$ref"), str):
                found.add(node["$ref"])
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return found


_STACK_SIZE_LOCK = threading.Lock()  # threading.stack_size is process-wide: set, start, restore


def on_deep_stack(fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) on a new thread with a COMPILE_STACK_BYTES stack; its result or its exception."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            box["error"] = exc

    with _STACK_SIZE_LOCK:
        before = threading.stack_size(COMPILE_STACK_BYTES)
        try:
            thread = threading.Thread(target=run, name="grammar-compile", daemon=True)
            thread.start()
        finally:
            threading.stack_size(before)
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]
