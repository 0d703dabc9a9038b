"""Structured output: time to compute the next-token mask, per token, with the GPT-2 vocabulary.

Each workload is a constraint and a text that satisfies it; the text's GPT-2 tokens (then EOS) are
replayed through the constraint, timing the mask before every token and checking that the token
was allowed. For 32 sequences, 32 copies start at staggered offsets into the text (each restarting
at EOS) and `fill_bitmask` fills all 32 rows per step; the figure is step time / 32.

    python bench/structured.py [--steps 200] [--compare]

Columns: compile (a cold compile, cache cleared, plus the first mask), fill for 1 and 32 sequences
(mean and p99 per token, 1 sequence; for 32, rows filled in a loop and on llguidance's thread
pool, POOL_THREADS threads), and `to bool`: turning one row into the (V,) bool mask the
sampler applies, the part every engine would share. --compare replays the same tokens through the
other engines that were considered, where installed (xgrammar, outlines-core), through their own
APIs with the same settings (compact JSON, no free whitespace).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere in the tree

from model import get_tokenizer  # noqa: E402
from model.grammar import (  # noqa: E402
    POOL_THREADS,
    Constraint,
    allocate_bitmask,
    bitmask_to_bool,
    clear_cache,
    compile_constraint,
    fill_bitmask,
    grammar_vocab,
)

ORDER_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 99999},
        "name": {"type": "string", "maxLength": 40},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.(com|org)$"},
        "status": {"enum": ["active", "suspended", "closed"]},
        "score": {"type": "number"},
        "verified": {"type": "boolean"},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}},
                "required": ["sku", "qty"],
                "additionalProperties": False,
            },
        },
        "note": {"type": ["string", "null"]},
    },
    "required": ["id", "name", "email", "status", "score", "verified", "address", "tags"],
    "additionalProperties": False,
}
ORDER = {
    "id": 4521,
    "name": "Ada Lovelace",
    "email": "ada@example.org",
    "status": "active",
    "score": 97.25,
    "verified": True,
    "address": {"street": "12 St James Square", "city": "London", "zip": "10001"},
    "tags": ["math", "engines", "poetry"],
    "items": [{"sku": "AE-1843", "qty": 2}, {"sku": "NOTE-G", "qty": 1}],
    "note": None,
}
PAPER = {
    "title": "On Computable Numbers",
    "year": 1936,
    "authors": [{"name": "Alan Turing", "born": 1912}],
    "pages": [230, 265],
    "open_access": False,
    "tags": {"field": "logic", "ref": None},
}
SUMMARY_SCHEMA = {
    "type": "object",
    "properties": {"title": {"type": "string"}, "summary": {"type": "string"}},
    "required": ["title", "summary"],
    "additionalProperties": False,
}
SUMMARY = {
    "title": "The Tempest",
    "summary": "A sorcerer, exiled to an island with his daughter, raises a storm to wreck the "
    "brother who took his dukedom; spirits, lovers and a plot later, he forgives them all, frees "
    "Ariel and gives up his magic before sailing home to Milan.",
}


def compact(value: object) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


# (name, kind, spec, text that satisfies it)
WORKLOADS: list[tuple[str, str, object, str]] = [
    ("json_schema", "json", ORDER_SCHEMA, compact(ORDER)),
    ("json long str", "json", SUMMARY_SCHEMA, compact(SUMMARY)),
    ("json_object", "json_object", None, compact(PAPER)),
    (
        "regex date",
        "regex",
        r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
        "2024-03-15",
    ),
    ("regex email", "regex", r"[a-z]+@[a-z]+\.(com|org|net)", "ada@example.org"),
    (
        "regex words",
        "regex",
        r"[A-Z][a-z]+( [a-z]+){2,12}\.",
        "Meeting with the team about the new release of the server.",
    ),
    ("choice", "choice", ["positive", "negative", "neutral", "mixed"], "neutral"),
]


def us(seconds: float) -> str:
    return f"{seconds * 1e6:8.1f}"


def replay_one(
    make: Callable[[], object],
    fill: Callable[[object, torch.Tensor], None],
    advance: Callable[[object, int], None],
    ids: list[int],
    vocab: int,
    eos: int,
    reps: int,
) -> list[float]:
    """Per-token mask times of `reps` replays of ids through fresh matchers."""
    bitmask = allocate_bitmask(1, vocab)
    times = []
    for _ in range(reps):
        state = make()
        for t in ids:
            start = time.perf_counter()
            fill(state, bitmask)
            times.append(time.perf_counter() - start)
            if not (int(bitmask[0, t // 32]) >> (t % 32)) & 1:
                raise AssertionError(f"token {t} rejected after {len(times)} tokens")
            if t != eos:
                advance(state, t)
    return times


def batch_per_token(
    make: Callable[[], Constraint], ids: list[int], batch: int, steps: int, parallel: bool
) -> float:
    """fill_bitmask over `batch` sequences at staggered offsets; mean seconds per row."""
    eos = ids[-1]
    cons, pos = [], []
    for b in range(batch):
        c, off = make(), (b * (len(ids) - 1)) // batch
        for t in ids[:off]:
            c.advance(t)
        cons.append(c)
        pos.append(off)
    bitmask = allocate_bitmask(batch, cons[0].vocab_size)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fill_bitmask(cons, bitmask, parallel=parallel)
        times.append(time.perf_counter() - start)
        for b in range(batch):
            t = ids[pos[b]]
            if t == eos:
                cons[b], pos[b] = make(), 0
            else:
                cons[b].advance(t)
                pos[b] += 1
    return statistics.mean(times) / batch


def p99(times: list[float]) -> float:
    return sorted(times)[int(len(times) * 0.99)]


def ours(tok, steps: int) -> None:
    vocab, eos = tok.vocab_size, tok.eot_token
    start = time.perf_counter()
    grammar_vocab(tok)
    print(f"tokenizer data (once per tokenizer): {(time.perf_counter() - start) * 1e3:.0f} ms")
    bitmask = allocate_bitmask(1, vocab)
    start = time.perf_counter()
    for _ in range(200):
        bitmask_to_bool(bitmask, vocab)
    to_bool = (time.perf_counter() - start) / 200
    print(
        f"\n{'workload':14s} {'tokens':>6s} {'compile ms':>10s} {'B=1 us/tok':>10s} "
        f"{'p99':>8s} {'B=32 loop':>9s} {'B=32 pool':>9s} {'to bool us':>10s}"
    )
    for name, kind, spec, text in WORKLOADS:
        ids = tok.encode(text) + [eos]
        clear_cache()
        start = time.perf_counter()
        first = compile_constraint(kind, spec, tok)  # type: ignore[arg-type]
        first.fill_bitmask(bitmask)
        compile_s = time.perf_counter() - start

        def make(kind: str = kind, spec: object = spec) -> Constraint:
            return compile_constraint(kind, spec, tok)  # type: ignore[arg-type]

        one = replay_one(
            make, lambda c, m: c.fill_bitmask(m), lambda c, t: c.advance(t), ids, vocab, eos, 5
        )
        loop = batch_per_token(make, ids, 32, steps, parallel=False)
        pool = batch_per_token(make, ids, 32, steps, parallel=True)
        print(
            f"{name:14s} {len(ids):6d} {compile_s * 1e3:10.2f} {us(statistics.mean(one)):>10s} "
            f"{us(p99(one))} {us(loop):>9s} {us(pool):>9s} {us(to_bool):>10s}"
        )


def compare_xgrammar(tok) -> None:
    try:
        import xgrammar as xgr
    except ImportError:
        print("xgrammar: not installed")
        return
    vocab, eos = tok.vocab_size, tok.eot_token
    tokens = [b"" if i == eos else tok.token_bytes(i) for i in range(vocab)]
    info = xgr.TokenizerInfo(tokens, xgr.VocabType.RAW, vocab_size=vocab, stop_token_ids=[eos])
    for name, kind, spec, text in WORKLOADS:
        compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        start = time.perf_counter()
        if kind == "regex":
            grammar = compiler.compile_regex(spec)
        elif kind == "choice":
            grammar = compiler.compile_json_schema({"enum": spec})  # no choice API: closest
            text = json.dumps(text)
        else:
            schema = {"type": "object"} if spec is None else spec
            grammar = compiler.compile_json_schema(
                schema, any_whitespace=False, separators=(",", ":")
            )
        xgr.GrammarMatcher(grammar).fill_next_token_bitmask(allocate_bitmask(1, vocab))
        compile_s = time.perf_counter() - start
        one = replay_one(
            lambda g=grammar: xgr.GrammarMatcher(g),
            lambda m, b: m.fill_next_token_bitmask(b),
            lambda m, t: m.accept_token(t),
            tok.encode(text) + [eos],
            vocab,
            eos,
            5,
        )
        print(
            f"xgrammar       {name:14s} compile {compile_s * 1e3:8.2f} ms  "
            f"B=1 {us(statistics.mean(one))} us/tok  p99 {us(p99(one))}"
        )


def compare_outlines(tok) -> None:
    try:
        import outlines_core
    except ImportError:
        print("outlines-core: not installed")
        return
    vocab, eos = tok.vocab_size, tok.eot_token
    by_bytes: dict[bytes, list[int]] = {}
    for i in range(vocab):
        if i != eos:
            by_bytes.setdefault(tok.token_bytes(i), []).append(i)
    vocabulary = outlines_core.Vocabulary(eos, by_bytes)
    for name, kind, spec, text in WORKLOADS:
        if kind == "choice":
            continue  # a regex alternation: the same as the regex rows
        start = time.perf_counter()
        regex = spec
        if kind != "regex":
            schema = json.dumps({"type": "object"} if spec is None else spec)
            regex = outlines_core.json_schema.build_regex_from_schema(schema, whitespace_pattern="")
        index = outlines_core.Index(regex, vocabulary)
        compile_s = time.perf_counter() - start
        one = replay_one(
            lambda i=index: outlines_core.Guide(i),
            lambda g, b: g.write_mask_into(b.data_ptr(), b.numel(), 4),
            lambda g, t: g.advance(t, return_tokens=False),
            tok.encode(text) + [eos],
            vocab,
            eos,
            5,
        )
        print(
            f"outlines-core  {name:14s} compile {compile_s * 1e3:8.2f} ms  "
            f"B=1 {us(statistics.mean(one))} us/tok  p99 {us(p99(one))}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="batched fill steps per workload")
    parser.add_argument("--compare", action="store_true", help="also time xgrammar, outlines-core")
    args = parser.parse_args()
    tok = get_tokenizer("gpt2")
    print(f"llguidance (model/grammar.py), GPT-2 vocabulary, pool of {POOL_THREADS} threads")
    ours(tok, args.steps)
    if args.compare:
        print()
        compare_xgrammar(tok)
        compare_outlines(tok)


if __name__ == "__main__":
    main()
