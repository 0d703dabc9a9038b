"""A Gemma 3 decode step through one compiled call a layer, against its modules and a Llama.

    python bench/gemma_layer.py [--streams 1,16] [--rounds 6] [--threads N]

Two random models of SmolLM2-135M's shape (30 layers, 576 wide, 9 query and 3 key/value heads of
64, a feed-forward block 1536 wide, 49152 tokens, tied embeddings), every layer product int4 in
groups of 32 (each group's minimum and step, as a GGUF file's Q4_1 layers), the tied head int8
(`model.quantize.Int8Linear`, as the default model's Q8_0 table is served):

- a Llama (RMSNorm, SwiGLU), its layers one `llama_decode_layer` call (`model.cpu.llama_layer`);
- a Gemma 3 of the same shape: (1 + w) RMSNorms around both branches and on each query and key
  head, GeGLU, the embedding times sqrt(576), five sliding layers (window 512) to one global,
  each with its rotary base; its layers one `gemma_decode_layer` call (`model.cpu.gemma_layer`).

Four engines over the two models, each with its own KV cache and `--streams` sequences of
64-token prompts, take 10 greedy steps in turn: the Llama through its calls and through its
modules (`Block.forward_cached`), the Gemma through its modules and through its calls. Each
round every engine takes its 10 steps, so their contexts grow alike; the table gives each side's
best and median wall time and median CPU time over the rounds (ms a step; tokens a second at
the best), and the two ratios that matter: Gemma's calls against its modules (what the call
gained) and against the Llama's calls (what Gemma's extra norms and GeGLU still cost).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

sys.path.append(str(Path(__file__).resolve().parents[1]))

from gptserve.engine.engine import Engine, EngineConfig  # noqa: E402
from gptserve.engine.sampler import SamplingParams  # noqa: E402
from gptserve.kernels.cpu.native import native_ops  # noqa: E402
from gptserve.model import GPT, ModelConfig, get_tokenizer  # noqa: E402
from gptserve.model.cpu import optimize_for_cpu  # noqa: E402
from gptserve.model.cpu.gemma_layer import FusedGemmaBlock  # noqa: E402
from gptserve.model.cpu.llama_layer import FusedLlamaBlock  # noqa: E402
from gptserve.model.cpu.malloc_tuning import retain_freed_memory  # noqa: E402
from gptserve.model.gguf.blocks import GROUP, Int4Groups  # noqa: E402
from gptserve.model.gpt import Block  # noqa: E402
from gptserve.model.int4_linear import Int4Linear  # noqa: E402
from gptserve.model.quantize import Int8Embedding, Int8Linear  # noqa: E402

from bench.host import print_host  # noqa: E402

SMOLLM2 = dict(vocab_size=49152, block_size=2048, n_layer=30, n_head=9, n_kv_head=3, n_embd=576,
               intermediate_size=1536, bias=False, pos_encoding="rotary", tokenizer="gpt2",
               layer_norm_eps=1e-5, tie_embeddings=True)  # fmt: skip
LLAMA = ModelConfig(**SMOLLM2, norm="rmsnorm", activation="swiglu", rope_theta=100_000.0)
GEMMA = ModelConfig(
    **SMOLLM2, norm="gemma_rmsnorm", activation="geglu", qk_norm=True, sandwich_norm=True,
    rope_theta=1_000_000.0, rope_local_theta=10_000.0, sliding_window=512,
    layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(30)],
    embed_scale=576**0.5, query_pre_attn_scalar=64,
)  # fmt: skip
PROMPT, STEPS = 64, 10  # prompt tokens of each sequence; steps an engine takes a turn


def int4_of(linear: nn.Linear) -> Int4Linear:
    """`linear` as int4 groups of 32: each group's minimum and a step of 1/15 of its range."""
    w = linear.weight.detach().float().numpy()
    rows, cols = w.shape
    groups = w.reshape(rows, cols // GROUP, GROUP)
    low, high = groups.min(-1), groups.max(-1)
    step = np.maximum((high - low) / 15, 1e-8).astype(np.float32)
    codes = np.clip(np.rint((groups - low[..., None]) / step[..., None]), 0, 15).astype(np.uint8)
    zeros = (low + 8 * step).astype(np.float32)  # w = (code - 8) * step + zero
    return Int4Linear(Int4Groups(codes.reshape(rows, cols), step, zeros), compiled=True)


@torch.no_grad()
def build(config: ModelConfig) -> GPT:
    """A random model of `config`, its layer products int4 and its head int8, optimized for the
    CPU."""
    torch.manual_seed(0)
    model = GPT(config).eval()
    for name, p in model.named_parameters():
        if "norm" in name and config.norm == "gemma_rmsnorm":
            p.normal_(0.0, 0.3)  # Gemma's norms hold w of (1 + w): around 0
    for block in model.transformer.h:
        attn, mlp = block.attn, block.mlp
        attn.c_attn, attn.c_proj = int4_of(attn.c_attn), int4_of(attn.c_proj)
        mlp.c_fc, mlp.c_proj = int4_of(mlp.c_fc), int4_of(mlp.c_proj)
    model.lm_head = Int8Linear(model.lm_head)
    model.transformer.wte = Int8Embedding(model.lm_head)  # tied: one int8 table
    return optimize_for_cpu(model)


def engine(model: GPT, streams: int, steps: int) -> Engine:
    """An engine over `model` with `streams` sequences of PROMPT random tokens, past their
    prefill, with room for `steps` more steps."""
    new = steps + 8
    blocks = streams * -(-(PROMPT + new) // 16) + 8  # the default blocks of 16 tokens
    eng = Engine(model, get_tokenizer(), EngineConfig(max_num_seqs=streams, num_blocks=blocks))
    gen = torch.Generator().manual_seed(streams)
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    for i in range(streams):
        prompt = torch.randint(0, model.config.vocab_size, (PROMPT,), generator=gen).tolist()
        eng.add_request(str(i), prompt, params)
    for _ in range(3):  # the prefill, then a decode step or two
        eng.step()
    return eng


def step_ms(eng: Engine, fused: type, one_call: bool) -> tuple[float, float]:
    """Wall and CPU ms a step of `eng` over STEPS steps, `fused` layers through their calls or
    their modules. The CPU time is the process's (all its threads, spinning ones included):
    with one thread, a figure that other processes on a busy host move less than the wall's."""
    compiled = fused.forward_cached
    if not one_call:
        fused.forward_cached = Block.forward_cached  # each block's own (Sandwich) residuals
    try:
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(STEPS):
            eng.step()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        return 1000 * wall / STEPS, 1000 * cpu / STEPS
    finally:
        fused.forward_cached = compiled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", default="1,16", help="comma-separated sequence counts")
    parser.add_argument("--rounds", type=int, default=6, help="turns of STEPS steps per engine")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch's threads (default: its own)"
    )
    args = parser.parse_args()
    try:
        streams = [int(s) for s in args.streams.split(",")]
    except ValueError:
        parser.error(f"--streams takes comma-separated counts, not {args.streams!r}")
    if min(streams) < 1 or args.rounds < 1 or (args.threads is not None and args.threads < 1):
        parser.error("--streams, --rounds and --threads take positive numbers")
    if args.threads:
        torch.set_num_threads(args.threads)
    print_host()
    retain_freed_memory()  # as the CLIs do
    if native_ops() is None:
        print("gemma_layer: the compiled kernels are not built here (GPTSERVE_NATIVE=0?)")
        return
    llama, gemma = build(LLAMA), build(GEMMA)
    assert all(type(b) is FusedLlamaBlock for b in llama.transformer.h)
    assert all(type(b) is FusedGemmaBlock for b in gemma.transformer.h)
    sides = [  # name, model, its one-call block type, one call or modules
        ("Llama, modules", llama, FusedLlamaBlock, False),
        ("Llama, one call", llama, FusedLlamaBlock, True),
        ("Gemma 3, modules", gemma, FusedGemmaBlock, False),
        ("Gemma 3, one call", gemma, FusedGemmaBlock, True),
    ]
    print(f"\n{torch.get_num_threads()} threads, torch {torch.__version__}; SmolLM2-135M's shape, "
          f"int4 layers; {args.rounds} rounds of {STEPS} steps a side\n")  # fmt: skip
    print(f"{'streams':>7s} {'side':20s} {'best ms':>8s} {'median ms':>10s} {'CPU ms':>7s} "
          f"{'tok/s':>8s}")  # fmt: skip
    for n in streams:
        engines = [engine(model, n, args.rounds * STEPS) for _, model, _, _ in sides]
        walls: list[list[float]] = [[] for _ in sides]
        cpus: list[list[float]] = [[] for _ in sides]
        for r in range(args.rounds):
            order = range(len(sides)) if r % 2 == 0 else reversed(range(len(sides)))
            for i in order:
                _, _, fused, one_call = sides[i]
                wall, cpu = step_ms(engines[i], fused, one_call)
                walls[i].append(wall)
                cpus[i].append(cpu)
        best = [min(t) for t in walls]
        medians = [statistics.median(t) for t in walls]
        cpu = [statistics.median(t) for t in cpus]
        for (name, *_), low, mid, used in zip(sides, best, medians, cpu):
            print(f"{n:7d} {name:20s} {low:8.2f} {mid:10.2f} {used:7.2f} {1000 * n / low:8.1f}")
        for label, ms in (("best", best), ("median", medians), ("CPU", cpu)):
            llama_calls, gemma_modules, gemma_calls = ms[1], ms[2], ms[3]
            print(f"{n:7d} {label}: Gemma 3's one call {gemma_modules / gemma_calls:.2f}x its "
                  f"modules' speed, {gemma_calls / llama_calls:.2f}x the Llama call's time")  # fmt: skip
        del engines


if __name__ == "__main__":
    main()
