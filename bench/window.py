"""Sliding-window decode on a CPU: a step's attention over the paged cache with every layer
windowed against the same step with global layers, in one run, and the blocks a long generation
holds.

    python bench/window.py [--context 4096] [--window 512] [--batch 8]

1. Decode attention (GPT-2 124M's 12 layers of 12 heads of 64; Mistral's window is 4096 of a
   32k context, here scaled down): `batch` sequences of `context` tokens, one step through
   `KVPools` (its plan, then every layer's writes and attention: the compiled kernel where it is
   built, else PyTorch's), global layers against layers with a window of `window` tokens, which
   read only the blocks their window reaches. The two sides run in alternation; each keeps its
   best of 7.
2. A tiny random all-windowed model (window 32) generating 400 tokens through the Engine: the
   most KV blocks it holds at once, against the same weights with a global layer.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))

from gptserve.engine.block_manager import BlockManager  # noqa: E402
from gptserve.engine.engine import Engine, EngineConfig  # noqa: E402
from gptserve.engine.sampler import SamplingParams  # noqa: E402
from gptserve.kernels.cpu.native import native_ops  # noqa: E402
from gptserve.kernels.paged_kv import KVPools  # noqa: E402
from gptserve.model import GPT, ModelConfig, get_tokenizer  # noqa: E402

BS = 16


def best_ms(fns, rounds: int = 7) -> list[float]:
    """Each callable's best milliseconds, run turn about."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for fn, out in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            out.append(1000 * (time.perf_counter() - t0))
    return [min(t) for t in times]


def attention_ms(context: int, window: int, batch: int) -> tuple[float, float]:
    torch.manual_seed(0)
    n_blocks = batch * (context // BS + 1) + 1
    pools = {
        w: KVPools(12, 12, 64, n_blocks, BS, windows=(w,) * 12) for w in (None, window)
    }  # the same memory for both: one pool's tensors
    base = pools[None]
    base.k.normal_(), base.v.normal_()
    pools[window].k, pools[window].v = base.k, base.v
    pools[window]._layers = base._layers
    blocks = BlockManager(n_blocks, BS)
    blocks.prepare([(i, context - 1) for i in range(batch)])
    meta = blocks.prepare([(i, 1) for i in range(batch)]).meta
    q, k, v = torch.randn(batch, 12, 64), torch.randn(batch, 12, 64), torch.randn(batch, 12, 64)

    def step(cache: KVPools) -> None:
        plan = cache.plan(meta)
        for layer in range(12):
            cache.attend(layer, q, k, v, plan)

    full, windowed = best_ms([lambda: step(pools[None]), lambda: step(pools[window])])
    return full, windowed


def held_blocks(layer_types: list[str] | None) -> int:
    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=50257, block_size=1024, n_layer=2, n_head=4, n_kv_head=2, n_embd=64,
        pos_encoding="rotary", norm="rmsnorm", activation="swiglu", bias=False,
        sliding_window=32, layer_types=layer_types,
    )  # fmt: skip
    engine = Engine(GPT(config).eval(), get_tokenizer(), EngineConfig(kv_block_size=BS))
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    engine.add_request("r", list(range(100, 120)), params)
    peak = 0
    while engine.has_work():
        engine.step()
        peak = max(peak, engine.blocks.num_blocks - engine.blocks.num_free_blocks)
    return peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    path = "compiled" if native_ops() is not None else "PyTorch"
    full, windowed = attention_ms(args.context, args.window, args.batch)
    print(f"| decode attention, {args.batch} seq x {args.context} tokens x 12 layers ({path}) "
          f"| global {full:.2f} ms | window {args.window}: {windowed:.2f} ms "
          f"| {full / windowed:.1f}x |")  # fmt: skip
    mixed = held_blocks(["sliding_attention", "full_attention"])
    windowed_held = held_blocks(None)
    print(f"| most KV blocks held, 20 + 400 tokens (block {BS}) | a global layer: {mixed} "
          f"| every layer window 32: {windowed_held} | |")  # fmt: skip


if __name__ == "__main__":
    main()
