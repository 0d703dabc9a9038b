"""Structured output: time to compute the next-token mask, per token, with the GPT-2 vocabulary.

Each workload is a constraint and a text that satisfies it; the text's GPT-2 tokens (then EOS) are
replayed through the constraint, timing the mask before every token and checking that the token
was allowed. For 32 sequences, 32 copies start at staggered offsets into the text (each restarting
at EOS) and `fill_bitmask` fills all 32 rows per step; the figure is step time / 32.

    python bench/structured.py [--steps 200] [--compare]
    python bench/structured.py --engine [--small] [--rounds 5] [--new-tokens 32] [--threads N]

Columns: compile (a cold compile, cache cleared, plus the first mask), fill for 1 and 32 sequences
(mean and p99 per token, 1 sequence; for 32, rows filled in a loop and on llguidance's thread
pool, POOL_THREADS threads), and `to bool`: turning one row into the (V,) bool mask the
sampler applies, the part every engine would share. --compare replays the same tokens through the
other engines that were considered, where installed (xgrammar, outlines-core), through their own
APIs with the same settings (compact JSON, no free whitespace).

--engine: tokens/s of constrained against free generation through the Engine, 1 and 32 streams,
on a random GPT-2 124M (`--small`: 4 layers, 256 wide) passed through `optimize_for_cpu` as the
CLIs do. Each stream generates exactly --new-tokens tokens: the free ones ignore EOS, the
constrained ones follow a schema (an array of orders) that cannot close that soon. Each round runs
the two sides back to back (which goes first alternates), so a slow spell on a shared machine does
not land on one side only; the ratio is the median of the rounds' ratios. Besides wall-clock
tokens/s it reports tokens per CPU-second of this process, which other processes' load moves much
less. Last, one timed run per side at the widest batch says where a step's time goes: the model,
the sampler (which applies the mask), filling the mask, turning it into the bool mask, advancing
the grammars.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))  # run from anywhere in the tree

import gptserve.engine.engine as engine_module  # noqa: E402
from gptserve.engine.engine import Engine, EngineConfig  # noqa: E402
from gptserve.engine.grammar import (  # noqa: E402
    POOL_THREADS,
    Constraint,
    allocate_bitmask,
    bitmask_to_bool,
    clear_cache,
    compile_constraint,
    fill_bitmask,
    grammar_vocab,
)
from gptserve.engine.loader import prepare_for_inference  # noqa: E402
from gptserve.engine.sampler import SamplingParams  # noqa: E402
from gptserve.model import GPT, ModelConfig, get_tokenizer  # noqa: E402

from bench.host import print_host  # noqa: E402

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
    ("json_object", "json", {"type": "object"}, compact(PAPER)),
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


# ---- through the engine: constrained against free generation ----

# orders, as many as fit: no stream can finish the array within the tokens generated
ORDERS_SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 99999},
            "customer": {"type": "string", "maxLength": 12},
            "status": {"enum": ["open", "shipped", "closed"]},
            "express": {"type": "boolean"},
            "lines": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                    },
                    "required": ["sku", "qty"],
                    "additionalProperties": False,
                },
                "maxItems": 3,
            },
        },
        "required": ["id", "customer", "status", "express", "lines"],
        "additionalProperties": False,
    },
    "minItems": 1000,
}


def run_streams(
    engine: Engine, prompts: list[list[int]], new: int, constraint: Constraint | None
) -> tuple[float, float]:
    """Generate `new` tokens for every prompt at once (sampled, seeded); returns (wall seconds,
    this process's CPU seconds)."""
    for i, prompt in enumerate(prompts):
        params = SamplingParams(
            temperature=1.0, seed=i, max_tokens=new, ignore_eos=True, constraint=constraint
        )
        engine.add_request(str(i), prompt, params)
    produced = 0
    start, cpu_start = time.perf_counter(), time.process_time()
    while engine.has_work():
        for event in engine.step():
            produced += len(event.token_ids)
            if event.error is not None:
                raise RuntimeError(event.error)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    if produced != new * len(prompts):
        raise AssertionError(f"{produced} tokens, not {new} x {len(prompts)}")
    return seconds, cpu


@contextmanager
def timed_parts(engine: Engine, totals: dict[str, float]) -> Iterator[None]:
    """Add the CPU time (this process's) of the engine's parts to `totals` while inside."""
    wrapped = [
        (engine.model, "forward_cached", "model forward"),
        (engine_module, "sample", "sampler (applies the mask)"),
        (engine_module, "fill_bitmask", "fill mask (llguidance)"),
        (engine_module, "bitmask_to_bool", "bitmask -> bool"),
        (Constraint, "advance", "advance grammars"),
    ]
    originals = [getattr(owner, name) for owner, name, _ in wrapped]

    def timer(function: Callable, label: str) -> Callable:
        def timed(*args: object, **kwargs: object) -> object:
            start = time.process_time()
            try:
                return function(*args, **kwargs)
            finally:
                totals[label] += time.process_time() - start

        return timed

    try:
        for (owner, name, label), original in zip(wrapped, originals):
            setattr(owner, name, timer(original, label))
        yield
    finally:
        for (owner, name, _), original in zip(wrapped, originals):
            if owner is engine.model:
                delattr(owner, name)  # the instance attribute shadowed the method
            else:
                setattr(owner, name, original)


def engine_bench(args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    print_host()
    torch.manual_seed(0)
    config = ModelConfig(n_layer=4, n_head=4, n_embd=256) if args.small else ModelConfig()
    model = GPT(config)
    n_params = model.num_params()
    model = prepare_for_inference(model)
    tok = get_tokenizer("gpt2")
    widths = [int(x) for x in args.streams.split(",")]
    engine = Engine(model, tok, EngineConfig(max_num_seqs=max(widths), kv_block_size=16))
    constraint = compile_constraint("json", ORDERS_SCHEMA, tok, vocab_size=config.vocab_size)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, tok.vocab_size, (16,), generator=gen).tolist() for _ in range(64)]
    new = args.new_tokens
    run_streams(engine, prompts[:2], 4, None)  # warm-up, both sides
    run_streams(engine, prompts[:2], 4, constraint)
    sides = [("free", None), ("constrained", constraint)]
    wall: dict[tuple[str, int], list[float]] = defaultdict(list)  # tok/s, one per round
    cpu: dict[tuple[str, int], list[float]] = defaultdict(list)  # tok per CPU-second
    for r in range(args.rounds):
        for width in widths:
            for side, c in sides if (r + width) % 2 == 0 else sides[::-1]:
                seconds, cpu_seconds = run_streams(engine, prompts[:width], new, c)
                wall[(side, width)].append(width * new / seconds)
                cpu[(side, width)].append(width * new / cpu_seconds)
                print(
                    f"  round {r + 1}: {side:11s} x{width:<3d} {wall[(side, width)][-1]:8.1f} "
                    f"tok/s  {cpu[(side, width)][-1]:8.1f} tok/CPU-s",
                    flush=True,
                )
    # where the time goes at the widest batch: each side's cheapest of two timed runs
    widest = max(widths)
    parts: dict[str, dict[str, float]] = {}
    for side, c in sides + sides[::-1]:
        totals: dict[str, float] = defaultdict(float)
        with timed_parts(engine, totals):
            totals["total"] = run_streams(engine, prompts[:widest], new, c)[1]
        if side not in parts or totals["total"] < parts[side]["total"]:
            parts[side] = totals

    print(
        f"\nengine: random GPT-2 {n_params / 1e6:.0f}M ({config.n_layer} layers, "
        f"{config.n_embd} wide), float32, CPU, {torch.get_num_threads()} threads, prompt 16, "
        f"{new} new tokens per stream, temperature 1, {args.rounds} alternating rounds"
    )
    print(
        "tok/s: wall clock, best round; tok/CPU-s: tokens per CPU-second of this process, median "
        "round (other processes' load moves it less); ratio: constrained / free, paired by round, "
        "median"
    )
    print(
        f"{'streams':>7} {'free tok/s':>11} {'constr. tok/s':>14} {'ratio':>6}   "
        f"{'free tok/CPU-s':>14} {'constr. tok/CPU-s':>17} {'ratio':>6} {'cost':>6}"
    )
    for width in widths:
        free, con = wall[("free", width)], wall[("constrained", width)]
        free_cpu, con_cpu = cpu[("free", width)], cpu[("constrained", width)]
        ratio = statistics.median(c / f for c, f in zip(con, free))
        ratio_cpu = statistics.median(c / f for c, f in zip(con_cpu, free_cpu))
        print(
            f"{width:7d} {max(free):11.1f} {max(con):14.1f} {ratio:6.3f}   "
            f"{statistics.median(free_cpu):14.1f} {statistics.median(con_cpu):17.1f} "
            f"{ratio_cpu:6.3f} {1 - ratio_cpu:6.1%}"
        )
    steps = new + 1  # the prefill step samples the first token
    print(f"\nwhere a step's time goes at x{widest}, CPU ms per step (cheaper of two timed runs):")
    print(f"  {'':28s} {'free':>8s} {'constrained':>12s}")
    labels = ["model forward", "sampler (applies the mask)", "fill mask (llguidance)",
              "bitmask -> bool", "advance grammars"]  # fmt: skip
    for label in [*labels, "rest (engine)", "total"]:
        row = []
        for side in ("free", "constrained"):
            t = parts[side]
            value = t["total"] - sum(t[k] for k in labels) if label == "rest (engine)" else t[label]
            row.append(value / steps * 1e3)
        print(f"  {label:28s} {row[0]:8.2f} {row[1]:12.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="batched fill steps per workload")
    parser.add_argument("--compare", action="store_true", help="also time xgrammar, outlines-core")
    parser.add_argument(
        "--engine", action="store_true", help="tokens/s through the Engine, constrained vs free"
    )
    parser.add_argument("--small", action="store_true", help="--engine: a 4-layer, 256-wide model")
    parser.add_argument("--streams", default="1,32", help="--engine: concurrent streams")
    parser.add_argument("--rounds", type=int, default=5, help="--engine: alternating rounds")
    parser.add_argument("--new-tokens", type=int, default=32, help="--engine: tokens per stream")
    parser.add_argument(
        "--threads", type=int, default=0, help="--engine: torch threads (0: torch's default)"
    )
    args = parser.parse_args()
    if args.engine:
        engine_bench(args)
        return
    print_host(bandwidth=False)  # the masks run on llguidance's threads, not torch's
    tok = get_tokenizer("gpt2")
    print(f"llguidance (engine/grammar.py), GPT-2 vocabulary, pool of {POOL_THREADS} threads")
    ours(tok, args.steps)
    if args.compare:
        print()
        compare_xgrammar(tok)
        compare_outlines(tok)


if __name__ == "__main__":
    main()
