"""Decode speed: our engine against Hugging Face transformers' generate() on the same weights.

    python bench/decode.py                 # random GPT-2 124M, fp32, CPU
    python bench/decode.py --device cuda   # on a GPU (fp32 unless --dtype)

Both sides get a 64-token prompt and produce 128 new tokens greedily; the table gives tokens/s,
the ratio, the achieved weight bandwidth (weight bytes x tokens/s), aggregate tokens/s at 1, 8 and
32 concurrent sequences, and where a decode step's time goes.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections import defaultdict

import torch

import server.engine as engine_module
from model import get_tokenizer, load_checkpoint
from model.cpu import optimize_for_cpu
from model.cpu_memory import retain_freed_memory
from model.sampling import SamplingParams
from server.engine import Engine, EngineConfig


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def hf_model(args):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    return GPT2LMHeadModel(cfg).eval()


def time_hf(hf, prompt: torch.Tensor, new: int, device: str) -> tuple[float, list[int]]:
    mask = torch.ones_like(prompt)
    kw = dict(do_sample=False, pad_token_id=0, attention_mask=mask)
    with torch.no_grad():
        hf.generate(prompt, max_new_tokens=4, min_new_tokens=4, **kw)  # warm-up
        sync(device)
        t0 = time.perf_counter()
        out = hf.generate(prompt, max_new_tokens=new, min_new_tokens=new, **kw)
        sync(device)
    return time.perf_counter() - t0, out[0, prompt.shape[1] :].tolist()


def run_engine(engine: Engine, prompts: list[list[int]], new: int, device: str):
    """Generate `new` tokens for every prompt at once; returns (seconds, tokens per request)."""
    for i, p in enumerate(prompts):
        engine.add_request(
            str(i), p, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
        )
    out: dict[str, list[int]] = defaultdict(list)
    sync(device)
    t0 = time.perf_counter()
    while engine.has_work():
        for ev in engine.step():
            out[ev.request_id].extend(ev.token_ids)
    sync(device)
    return time.perf_counter() - t0, out


class StepTimer:
    """Wall time spent in the engine's parts during decode steps."""

    def __init__(self, device: str) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.device = device

    def wrap(self, owner, name: str, label: str):
        original = getattr(owner, name)

        def timed(*a, **kw):
            sync(self.device)
            t0 = time.perf_counter()
            result = original(*a, **kw)
            sync(self.device)
            self.totals[label] += time.perf_counter() - t0
            return result

        setattr(owner, name, timed)
        return original


def step_breakdown(engine: Engine, prompt: list[int], new: int, device: str) -> dict[str, float]:
    timer = StepTimer(device)
    originals = [
        (engine.cache, "prepare", timer.wrap(engine.cache, "prepare", "cache bookkeeping")),
        (
            engine.model,
            "forward_cached",
            timer.wrap(engine.model, "forward_cached", "model forward"),
        ),
        (engine_module, "sample", timer.wrap(engine_module, "sample", "sampling")),
    ]
    try:
        total, _ = run_engine(engine, [prompt], new, device)
    finally:
        for owner, name, original in originals:
            if owner is engine.model or owner is engine.cache:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
    parts = dict(timer.totals)
    parts["engine overhead (rest)"] = total - sum(parts.values())
    return {k: v / total for k, v in parts.items()} | {"_total": total}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--n-head", type=int, default=12)
    p.add_argument("--n-embd", type=int, default=768)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--rounds", type=int, default=3, help="single-stream runs per side (best kept)")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    dev = args.device

    hf = hf_model(args)
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        ours = load_checkpoint(tmp, device=dev, dtype=dtype)
    hf = hf.to(device=dev, dtype=dtype)
    tok = get_tokenizer()
    gen = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, 50257, (args.prompt_len,), generator=gen).tolist() for _ in range(32)
    ]
    new = args.new_tokens

    weight_bytes = sum(t.numel() * t.element_size() for t in ours.parameters())
    n_params = ours.num_params()  # before the CPU layouts (which keep the head twice)
    retain_freed_memory()
    ours = optimize_for_cpu(ours)
    hf_prompt = torch.tensor([prompts[0]], device=dev)
    hf_s, hf_tokens = time_hf(hf, hf_prompt, new, dev)
    cfg = EngineConfig(max_num_seqs=32, block_size=16)
    engine = Engine(ours, tok, cfg)
    run_engine(engine, [prompts[0]], 4, dev)  # warm-up
    # single stream: alternate the two sides and keep each one's best, so a slow spell on a
    # shared machine does not land on one side only
    single_s, out = run_engine(engine, prompts[:1], new, dev)
    same = out["0"] == hf_tokens
    for _ in range(args.rounds - 1):
        hf_s = min(hf_s, time_hf(hf, hf_prompt, new, dev)[0])
        single_s = min(single_s, run_engine(engine, prompts[:1], new, dev)[0])
    single_rate = new / single_s
    rows = []
    for c in [int(x) for x in args.concurrency.split(",")]:
        if c == 1:
            rows.append((1, single_s, single_rate))
            continue
        secs, out = run_engine(engine, prompts[:c], new, dev)
        rows.append((c, secs, c * new / secs))
    breakdown = step_breakdown(engine, prompts[0], new, dev)

    hf_rate = new / hf_s
    print(
        f"\ndecode: GPT-2 {n_params / 1e6:.0f}M random weights, {args.dtype}, {dev}, "
        f"{torch.get_num_threads()} threads, prompt {args.prompt_len}, {new} new tokens, greedy"
    )
    print(f"greedy tokens identical to transformers: {'yes' if same else 'NO'}")
    print(f"{'':28}{'tok/s':>10}{'vs HF':>8}{'weights GB/s':>14}")
    print(
        f"{'transformers generate()':28}{hf_rate:10.1f}{1.0:8.2f}{weight_bytes * hf_rate / 1e9:14.1f}"
    )
    for c, _secs, rate in rows:
        label = f"gptserve engine x{c}"
        bw = f"{weight_bytes * single_rate / 1e9:14.1f}" if c == 1 else f"{'':14}"
        extra = "" if c == 1 else f"  ({rate / single_rate:.1f}x single stream)"
        print(f"{label:28}{rate:10.1f}{rate / hf_rate:8.2f}{bw}{extra}")
    print("\nwhere a single-stream request's time goes (prefill + decode steps):")
    for k, v in breakdown.items():
        if not k.startswith("_"):
            print(f"  {k:28}{100 * v:6.1f} %")


if __name__ == "__main__":
    main()
