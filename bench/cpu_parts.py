"""The CPU decode path's parts, each against what it replaced, in one run (GPT-2 124M shapes).

    python bench/cpu_parts.py

1. The 48 layer matrices (12 layers, all distinct so nothing stays in cache) and the vocabulary
   head, multiplied by 1, 8 and 32 rows: `nn.Linear` against weights in per-thread slabs
   (`PackedLinear`), and slabs against what the Engine uses now (`pack_linear`: oneDNN's layout;
   `pack_head`: slabs for one row, oneDNN for more); for one row, also the head in oneDNN's
   layout alone.
2. Decode attention for 1 and 32 sequences of 150-192 tokens over 12 layers: each sequence's
   keys and values gathered in one group against cache-sized groups (`kernels.sdpa_paged`), and
   those groups against head-major pools read in place (`kernels.paged_decode_cpu`).
3. A decode step of the Engine with 32 sequences, in two fresh processes: glibc's default
   allocator against the tuned one (model.cpu_memory), which parts 1 and 2 run with.

The two sides of a row run in alternation and each keeps its best, so the machine's slow spells
(memory bandwidth here drifts by 20 %) fall on both.
"""

from __future__ import annotations

import dataclasses
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kernels.paged_decode_cpu as paged_decode_cpu  # noqa: E402
import kernels.sdpa_paged as sdpa_paged  # noqa: E402
from model.cache import KVCache  # noqa: E402
from model.cpu import optimize_for_cpu  # noqa: E402
from model.cpu.onednn_linear import OneDnnLinear  # noqa: E402
from model.cpu.packed_linear import PackedLinear, pack_head, pack_linear, slab_count  # noqa: E402
from model.cpu_memory import retain_freed_memory  # noqa: E402

LAYER_SHAPES = [(768, 2304), (768, 768), (768, 3072), (3072, 768)]  # (in, out) per layer
Row = tuple[str, str, float, float]  # (part, what it replaced, before ms, after ms)


def alternate(before: Callable[[], object], after: Callable[[], object], rounds: int = 7):
    """Best milliseconds of each side, the two run turn about."""
    before(), after()
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(rounds):
        for fn, out in zip((before, after), times):
            t0 = time.perf_counter()
            fn()
            out.append(1000 * (time.perf_counter() - t0))
    return min(times[0]), min(times[1])


def apply_all(modules: list[nn.Module], plain: list[nn.Linear], xs: dict[int, torch.Tensor]):
    """A callable that multiplies each module by the input of its `nn.Linear`'s width."""
    return lambda: [m(xs[p.in_features]) for m, p in zip(modules, plain)]


@torch.no_grad()
def linear_rows() -> list[Row]:
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    layers = [nn.Linear(i, o) for _ in range(12) for i, o in LAYER_SHAPES]
    head = nn.Linear(768, 50257, bias=False)
    forms = {
        "48 layer matrices": (
            layers,
            [PackedLinear(m, slab_count(m, threads)) for m in layers],
            [pack_linear(m, threads) for m in layers],
        ),
        "vocabulary head": (
            [head],
            [PackedLinear(head, slab_count(head, threads), column_major=True)],
            [pack_head(head, threads)[0]],
        ),
    }
    rows = []
    for name, (plain, slabs, engine) in forms.items():
        for n in (1, 8, 32):
            xs = {768: torch.randn(n, 768), 3072: torch.randn(n, 3072)}
            before, slabbed, now = (apply_all(f, plain, xs) for f in (plain, slabs, engine))
            rows.append((f"{name}, {n} rows", "nn.Linear -> slabs", *alternate(before, slabbed)))
            rows.append((f"{name}, {n} rows", "slabs -> engine's", *alternate(slabbed, now)))
            if name == "vocabulary head" and n == 1:  # why the head keeps its slabs
                onednn = apply_all([OneDnnLinear(head)], plain, xs)
                rows.append((f"{name}, {n} rows", "oneDNN only -> engine's",
                             *alternate(onednn, now)))  # fmt: skip
    return rows


def attention_rows(batch: int) -> list[Row]:
    torch.manual_seed(0)
    cache = KVCache(12, 12, 64, num_blocks=batch * 12 + 8, block_size=16)
    cache.k.normal_(), cache.v.normal_()
    lens = torch.randint(150, 193, (batch,)).tolist()
    cache.prepare([(i, n - 1) for i, n in enumerate(lens)])
    step = cache.prepare([(i, 1) for i in range(batch)])  # a decode step
    q = torch.randn(batch, 12, 64)
    token_major = [(cache.k[i].contiguous(), cache.v[i].contiguous()) for i in range(12)]
    default_group = sdpa_paged.GROUP_BYTES

    def gather(one_group: bool) -> None:  # one step: the first layer builds the plan
        sdpa_paged.GROUP_BYTES = 1 << 40 if one_group else default_group
        meta = dataclasses.replace(step)  # a fresh step, no plan yet
        for k, v in token_major:
            sdpa_paged.paged_attention_sdpa(q, k, v, meta)

    def in_place() -> None:
        meta = dataclasses.replace(step)
        for i in range(12):
            paged_decode_cpu.decode_attention_cpu(q, cache.k[i], cache.v[i], meta)

    label = f"decode attention, {batch} seq x 12 layers"
    rows = []
    try:
        if batch > 1:
            times = alternate(lambda: gather(True), lambda: gather(False))
            rows.append((label, "one group -> groups", *times))
        rows.append((label, "groups -> in place", *alternate(lambda: gather(False), in_place)))
    finally:
        sdpa_paged.GROUP_BYTES = default_group
    return rows


def decode_step_ms(retain: bool) -> float:
    """Median decode step with 32 sequences (after 20 warm-up steps), in this process."""
    import server.engine as engine_module
    from model import GPT, ModelConfig, get_tokenizer
    from model.sampling import SamplingParams

    if retain:
        retain_freed_memory()
    torch.manual_seed(0)
    model = optimize_for_cpu(GPT(ModelConfig()))
    engine = engine_module.Engine(
        model, get_tokenizer(), engine_module.EngineConfig(max_num_seqs=32)
    )
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    for i in range(32):
        engine.add_request(str(i), torch.randint(0, 50257, (64,), generator=gen).tolist(), params)
    for _ in range(20):
        engine.step()
    times = []
    for _ in range(15):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def allocator_row() -> Row:
    def child(retain: bool) -> float:
        code = f"import bench.cpu_parts as b; print(b.decode_step_ms({retain}))"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True, cwd=Path(__file__).resolve().parents[1])  # fmt: skip
        return float(out.stdout.strip().splitlines()[-1])

    return ("engine decode step, 32 seqs", "glibc default -> tuned", child(False), child(True))


def main() -> None:
    retain_freed_memory()  # as the CLIs do (the allocator row compares both in subprocesses)
    rows = linear_rows() + attention_rows(1) + attention_rows(32) + [allocator_row()]
    print(f"\n{torch.get_num_threads()} threads, torch {torch.__version__}; best of 7 rounds, "
          "the two sides in turn (the engine step: median of 15, one process each)\n")  # fmt: skip
    print(f"{'':40s} {'what it replaced':24s} {'before ms':>10s} {'after ms':>9s} {'speed-up':>9s}")
    for name, change, before, after in rows:
        print(f"{name:40s} {change:24s} {before:10.1f} {after:9.1f} {before / after:8.2f}x")
    print(
        "\nslabs: PackedLinear; engine's: oneDNN's layout (the head: slabs for one row); "
        "groups: gather + SDPA in cache-sized groups; in place: kernels.paged_decode_cpu"
    )


if __name__ == "__main__":
    main()
