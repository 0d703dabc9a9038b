"""What `--batch-invariant` costs: engine steps of one model with the flag off and on, same run.

    python bench/batch_invariant.py [--model NAME|PATH] [--dtype bfloat16] [--quantize int8]

Loads the model twice (without and with the flag, as the server loads it) and times, engine
against engine, alternating rounds: a 512-token prompt's prefill, a decode step of 1 and of 16
streams, and a step of 16 decodes beside a 64-token prompt chunk (the steps where the flag's
attention, `kernels.cpu.row_invariant`, takes every new token as a decode). `--before` adds the
flag's attention as it was before that module (prompt rows by gather + SDPA or the cascade: not
batch-invariant), to say what the module itself costs. Prints the median of each in ms.
`--attention` times one layer's attention alone (the default model's heads: 9 query heads over
3 KV heads of 64), a prompt of 64 and 512 tokens, the flag's attention before and now, the
fastest of 20 calls each: robust on a shared host, where whole steps are not.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from gptserve.engine.engine import Engine, EngineConfig
from gptserve.engine.loader import load_for_inference
from gptserve.engine.sampler import SamplingParams
from gptserve.kernels import paged_kv
from gptserve.kernels.backends import CpuPagedBackend, KVSpec
from gptserve.kernels.cpu.row_invariant import RowInvariantCpuBackend
from gptserve.kernels.metadata import AttentionMetadata
from gptserve.model.known_models import DEFAULT_MODEL_NAME, fetch_known_model, known_name


def _engine(path, dtype: str, quantize: str, invariant: bool, before: bool = False) -> Engine:
    loaded = load_for_inference(
        path, device="cpu", dtype=dtype, quantization=quantize, batch_invariant=invariant
    )
    select = paged_kv.select_attention_backend
    if before:  # the flag's attention before kernels.cpu.row_invariant
        paged_kv.select_attention_backend = lambda d, t, b=False: CpuPagedBackend(batch_invariant=b)
    try:
        config = EngineConfig(batch_invariant=invariant, prefix_caching=False)
        return Engine(loaded.model, loaded.tokenizer, config)
    finally:
        paged_kv.select_attention_backend = select


class Case:
    """One engine's requests, stepped to the state a measurement needs."""

    def __init__(self, engine: Engine, seed: int) -> None:
        self.engine, self.rng, self.n = engine, random.Random(seed), 0

    def prompt(self, length: int) -> list[int]:
        return [self.rng.randrange(1000, 40000) for _ in range(length)]

    def add(self, length: int, params: SamplingParams) -> str:
        self.n += 1
        self.engine.add_request(f"r{self.n}", self.prompt(length), params)
        return f"r{self.n}"

    def clear(self) -> None:
        """Step until the case's requests end (each has a few tokens to make)."""
        while self.engine.has_work():
            self.engine.step()

    def timed_step(self) -> float:
        start = time.perf_counter()
        self.engine.step()
        return (time.perf_counter() - start) * 1000


def _prefill(case: Case) -> float:
    case.add(512, SamplingParams(temperature=0, max_tokens=1))
    ms = case.timed_step()
    case.clear()
    return ms


def _decode(streams: int):
    def run(case: Case) -> float:
        for _ in range(streams):
            case.add(32, SamplingParams(temperature=0, ignore_eos=True, max_tokens=6))
        case.engine.step()  # the prompts
        times = [case.timed_step() for _ in range(4)]
        case.clear()
        return statistics.median(times)

    return run


def _mixed(case: Case) -> float:
    for _ in range(16):
        case.add(32, SamplingParams(temperature=0, ignore_eos=True, max_tokens=4))
    case.engine.step()
    case.add(64, SamplingParams(temperature=0, max_tokens=1))
    ms = case.timed_step()  # 16 decodes and the 64-token prompt
    case.clear()
    return ms


def attention(dtype_name: str) -> None:
    """One layer's attention over a whole prompt, before and now: the fastest of 20 calls."""
    import torch

    dtype, bs, n_head, n_kv, dim = getattr(torch, dtype_name), 16, 9, 3, 64
    print(f"one layer's attention, {dtype_name} pools, fastest of 20, ms")
    print("| prompt | before (SDPA) | now (rows as decodes) | now / before |")
    print("|---|---|---|---|")
    for length in (64, 512):
        spec = KVSpec(
            1, length // bs + 2, bs, n_kv, dim, dtype, torch.device("cpu"), n_head // n_kv
        )
        meta = AttentionMetadata.build([list(range(length // bs + 1))], [length], [length], bs)
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(length, h, dim, generator=gen).to(dtype)
                   for h in (n_head, n_kv, n_kv))  # fmt: skip
        row = []
        for backend in (CpuPagedBackend(batch_invariant=True), RowInvariantCpuBackend()):
            k_pool, v_pool = (pool[0] for pool in backend.allocate(spec))
            plan = backend.plan(meta, spec)
            calls = []
            for _ in range(20):
                start = time.perf_counter()
                backend.forward(q, k, v, k_pool, v_pool, plan)
                calls.append((time.perf_counter() - start) * 1000)
            row.append(min(calls))
        print(f"| {length} | {row[0]:.2f} | {row[1]:.2f} | {row[1] / row[0]:.2f}x |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_MODEL_NAME)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--quantize", default="none")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--before", action="store_true", help="also the flag's attention before")
    p.add_argument("--attention", action="store_true", help="one layer's attention alone")
    args = p.parse_args()
    if args.attention:
        attention("bfloat16" if args.dtype == "bfloat16" else "float32")
        return
    path = fetch_known_model(args.model) if known_name(args.model) else args.model
    sides = {"off": _engine(path, args.dtype, args.quantize, False)}
    if args.before:
        sides["on, before"] = _engine(path, args.dtype, args.quantize, True, before=True)
    sides["on"] = _engine(path, args.dtype, args.quantize, True)
    cases = {side: Case(engine, seed=0) for side, engine in sides.items()}
    work = {"prefill 512": _prefill, "decode 1": _decode(1), "decode 16": _decode(16),
            "16 decodes + 64-token chunk": _mixed}  # fmt: skip
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):  # alternating: each side sees the same host load
        for name, run in work.items():
            for side, case in cases.items():
                times.setdefault((name, side), []).append(run(case))
    print(f"{args.model} dtype={args.dtype} quantize={args.quantize}, median of {args.rounds}, ms")
    print("| step | " + " | ".join(sides) + " | on / off |")
    print("|---|" + "---|" * (len(sides) + 1))
    for name in work:
        row = [statistics.median(times[(name, side)]) for side in sides]
        ratio = row[-1] / row[0]
        print(f"| {name} | " + " | ".join(f"{ms:.1f}" for ms in row) + f" | {ratio:.2f}x |")


if __name__ == "__main__":
    main()
