"""The CPU decode path's parts, each against what it replaced, in one run (GPT-2 124M shapes).

    python bench/cpu_parts.py

1. The 48 layer matrices (12 layers, all distinct so nothing stays in cache) and the vocabulary
   head, multiplied by 1, 8 and 32 rows: `nn.Linear` against `PackedLinear` as the Engine packs
   them (model.packed_linear).
2. Paged attention for 32 sequences of 150-192 tokens over 12 layers: all sequences in one group
   against groups that fit in cache (kernels.sdpa_paged.GROUP_BYTES).
3. A decode step of the Engine with 32 sequences, in two fresh processes: glibc's default
   allocator against the tuned one (model.cpu_memory).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kernels.sdpa_paged as sdpa_paged  # noqa: E402
from model.packed_linear import pack_linears  # noqa: E402

LAYER_SHAPES = [(768, 2304), (768, 768), (768, 3072), (3072, 768)]  # (in, out) per layer


def best_ms(fn, repeat: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * min(times)


def apply_all(modules: list[nn.Module], xs: dict[int, torch.Tensor]):
    """A callable that multiplies each module by the input of its width."""
    return lambda: [m(xs[m.in_features]) for m in modules]


@torch.no_grad()
def linear_rows() -> list[tuple[str, float, float]]:
    torch.manual_seed(0)
    layers = nn.ModuleList(nn.Linear(i, o) for _ in range(12) for i, o in LAYER_SHAPES)
    head = nn.ModuleList([nn.Linear(768, 50257, bias=False)])
    plain = {"48 layer matrices": list(layers), "vocabulary head": list(head)}
    pack_linears(layers, torch.get_num_threads())
    pack_linears(head, torch.get_num_threads())
    packed = {"48 layer matrices": layers, "vocabulary head": head}
    rows = []
    for name in plain:
        for n in (1, 8, 32):
            xs = {768: torch.randn(n, 768), 3072: torch.randn(n, 3072)}
            before = best_ms(apply_all(plain[name], xs))
            after = best_ms(apply_all(list(packed[name]), xs))
            rows.append((f"{name}, {n} rows", before, after))
    return rows


def attention_row() -> tuple[str, float, float]:
    torch.manual_seed(0)
    batch, heads, dim, block, blocks_per_seq, layers = 32, 12, 64, 16, 12, 12
    pools = [(torch.randn(800, block, heads, dim), torch.randn(800, block, heads, dim))
             for _ in range(layers)]  # fmt: skip
    tables = torch.randperm(800)[: batch * blocks_per_seq].view(batch, -1).int()
    ctx = torch.randint(150, 193, (batch,)).int()
    starts = torch.arange(batch + 1).int()
    q = torch.randn(batch, heads, dim)

    def step() -> None:
        for k, v in pools:
            sdpa_paged.paged_attention_sdpa(q, k, v, tables, ctx, starts)

    grouped = best_ms(step)
    default = sdpa_paged.GROUP_BYTES
    sdpa_paged.GROUP_BYTES = 1 << 40  # every sequence in one group
    try:
        sdpa_paged._last_plan = None
        one_group = best_ms(step)
    finally:
        sdpa_paged.GROUP_BYTES = default
        sdpa_paged._last_plan = None
    return ("paged attention, 32 seqs x 12 layers", one_group, grouped)


def decode_step_ms(retain: bool) -> float:
    """Median decode step with 32 sequences (after 20 warm-up steps), in this process."""
    import server.engine as engine_module
    from model import GPT, ModelConfig, get_tokenizer
    from model.sampling import SamplingParams

    if not retain:
        engine_module.retain_freed_memory = lambda: False
    torch.manual_seed(0)
    engine = engine_module.Engine(
        GPT(ModelConfig()), get_tokenizer(), engine_module.EngineConfig(max_num_seqs=32)
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


def allocator_row() -> tuple[str, float, float]:
    def child(retain: bool) -> float:
        code = f"import bench.cpu_parts as b; print(b.decode_step_ms({retain}))"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             check=True, cwd=Path(__file__).resolve().parents[1])  # fmt: skip
        return float(out.stdout.strip().splitlines()[-1])

    return ("engine decode step, 32 seqs (allocator)", child(False), child(True))


def main() -> None:
    rows = linear_rows() + [attention_row(), allocator_row()]
    print(f"\n{torch.get_num_threads()} threads, torch {torch.__version__}; best of 5 "
          "(the engine step: median of 15)\n")  # fmt: skip
    print(f"{'':44s} {'before ms':>10s} {'after ms':>9s} {'speed-up':>9s}")
    for name, before, after in rows:
        print(f"{name:44s} {before:10.1f} {after:9.1f} {before / after:8.2f}x")
    print("\nbefore: nn.Linear / one group / glibc defaults; after: PackedLinear / cache-sized "
          "groups / model.cpu_memory")


if __name__ == "__main__":
    main()
