"""Where a decode step's time goes, operation by operation, for any model the server loads.

    python bench/step_profile.py                                   # the default model, 1 stream
    python bench/step_profile.py --model smollm2-135m-instruct --streams 16 --threads 1
    python bench/step_profile.py --model PATH --top 25

The model loads as `gptserve serve --model ...` loads it (`load_for_inference`); `--streams`
requests of random prompt ids are prefilled, a few decode steps warm up, then `--steps` decode
steps are timed, then as many run under torch.profiler. The table gives each PyTorch operation's own time per step
(`self`: its kernel, without the operations it calls) and its calls per step; the last rows say
how much of the step the operations account for and what is left: Python, the dispatcher and the
engine's bookkeeping between operations. A last line times the model's forward inside steps
without the profiler: the rest of a step is the Engine's own work (scheduling, metadata,
sampling, events). A step made of many small operations is bound by that
rest, one made of a few large products by memory bandwidth.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.append(str(Path(__file__).resolve().parents[1]))

from gptserve.engine.engine import Engine, EngineConfig  # noqa: E402
from gptserve.engine.loader import load_for_inference  # noqa: E402
from gptserve.engine.sampler import SamplingParams  # noqa: E402
from gptserve.model.dtypes import DTYPES  # noqa: E402
from gptserve.model.known_models import resolve_model  # noqa: E402

from bench.host import print_host  # noqa: E402


def decode_steps(engine: Engine, steps: int) -> float:
    """Run `steps` engine steps (every request decoding); returns their seconds."""
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return time.perf_counter() - t0


def forward_share(engine: Engine, model, steps: int) -> tuple[float, float]:
    """Seconds of `steps` engine steps and of the model's forward inside them (timed around
    `forward_cached`): the difference is the Engine's own work, outside the forward."""
    inside = [0.0]
    forward = model.forward_cached

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return forward(*args, **kwargs)
        finally:
            inside[0] += time.perf_counter() - t0

    model.forward_cached = timed
    try:
        total = decode_steps(engine, steps)
    finally:
        del model.forward_cached  # the class's method again
    return total, inside[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="as `gptserve serve --model` (default: its)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantize", default="none")
    p.add_argument("--streams", type=int, default=1)
    p.add_argument("--int8-activations", action="store_true",
                   help="as `gptserve serve --int8-activations`")  # fmt: skip
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", *DTYPES),
                   help="as `gptserve serve --kv-cache-dtype`")  # fmt: skip
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=32, help="decode steps profiled")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--top", type=int, default=15, help="operations listed")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print_host()
    path = resolve_model(args.model)
    loaded = load_for_inference(
        path, device="cpu", dtype=args.dtype, quantization=args.quantize,
        int8_activations=args.int8_activations,
    )  # fmt: skip
    model = loaded.model
    total = args.prompt_len + 3 * args.steps + 16
    config = EngineConfig(
        max_num_seqs=args.streams, kv_block_size=16, prefix_caching=False,
        num_blocks=args.streams * -(-total // 16) + 4,
        kv_cache_dtype=DTYPES.get(args.kv_cache_dtype),
    )  # fmt: skip
    engine = Engine(model, loaded.tokenizer, config)
    gen = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    for i in range(args.streams):
        prompt = torch.randint(0, vocab, (args.prompt_len,), generator=gen).tolist()
        params = SamplingParams(temperature=0, max_tokens=3 * args.steps + 12, ignore_eos=True)
        engine.add_request(str(i), prompt, params)
    while engine.num_waiting:  # prefill every request
        engine.step()
    decode_steps(engine, 8)  # warm-up
    plain = decode_steps(engine, args.steps) / args.steps  # the step's time without the profiler
    total, forward = forward_share(engine, model, args.steps)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        profiled = decode_steps(engine, args.steps) / args.steps
    ops = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]  # aten, mkldnn, ...
    ops.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    per_step = 1e-6 / args.steps  # profiler microseconds -> seconds per step
    op_time = sum(e.self_cpu_time_total for e in ops) * per_step
    calls = sum(e.count for e in ops) / args.steps

    rows = ", 8-bit rows" if args.int8_activations else ""
    print(f"\n{path.name}: {loaded.quantization}{rows}, {loaded.dtype}, {args.streams} stream(s), "
          f"{torch.get_num_threads()} threads; decode step {plain * 1e3:.2f} ms "
          f"({args.streams / plain:.1f} tok/s), {profiled * 1e3:.2f} ms under the profiler")  # fmt: skip
    print(f"{'operation':40}{'ms/step':>9}{'share':>7}{'calls/step':>11}{'us/call':>9}")
    for e in ops[: args.top]:
        ms = e.self_cpu_time_total * per_step * 1e3
        print(f"{e.key:40}{ms:9.3f}{ms / (profiled * 1e3):7.1%}{e.count / args.steps:11.1f}"
              f"{e.self_cpu_time_total / e.count:9.1f}")  # fmt: skip
    rest = profiled - op_time
    print(f"{'all operations':40}{op_time * 1e3:9.3f}{op_time / profiled:7.1%}{calls:11.1f}")
    print(f"{'the rest (Python, dispatch, engine)':40}{rest * 1e3:9.3f}{rest / profiled:7.1%}")
    own = (total - forward) / args.steps
    print(f"\nwithout the profiler, the Engine's own work outside the model's forward: "
          f"{own * 1e6:.0f} us a step of {total / args.steps * 1e3:.2f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
