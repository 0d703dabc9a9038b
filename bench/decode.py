"""Decode speed: our engine, in each weight format, against Hugging Face transformers' generate().

    python bench/decode.py                                  # fp32, bf16 and int8 rows, CPU
    python bench/decode.py --rows fp32,int8                 # some of the rows
    python bench/decode.py --quantize int8 --dtype float32  # one row, as the server flags say
    python bench/decode.py --device cuda                    # on a GPU
    python bench/decode.py --no-speculative                 # without the speculative rows

Random GPT-2 124M weights. Every side gets a 64-token prompt and produces 128 new tokens
greedily; transformers runs in float32 (the baseline). The table gives tokens/s at 1 and more
concurrent sequences, the ratio to transformers and to our float32 row, the bytes of the weights
as served and the bandwidth a single stream reads them at (weight bytes x tokens/s), and where a
single-stream request's time goes. The single-stream figures are the best of --rounds rounds that
run every side in turn, so a slow spell on a shared machine falls on all of them.

A row is an entry of ROWS: a label, the weights' dtype and quantization, and EngineConfig
fields (a speculative row sets `speculative`, and `draft` builds its draft model).

Last, the speculative rows (`bench/decode_speculative.py`): plain, n-gram and draft-model
speculation, one stream, on the bundled default model, whose trained weights make guesses mean
something, for a prompt that repeats and one that does not.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))

import gptserve.engine.engine as engine_module  # noqa: E402
from gptserve.engine.engine import Engine, EngineConfig  # noqa: E402
from gptserve.engine.loader import (  # noqa: E402
    ModelLoadError,
    check_load,
    load_for_inference,
    prepare_for_inference,
)
from gptserve.engine.sampler import SamplingParams  # noqa: E402
from gptserve.model import GPT, load_checkpoint  # noqa: E402
from gptserve.model.cpu.malloc_tuning import retain_freed_memory  # noqa: E402
from gptserve.model.dtypes import DTYPES  # noqa: E402
from gptserve.model.quantize import QUANTIZATIONS  # noqa: E402

from bench.decode_speculative import speculative_rows  # noqa: E402
from bench.host import print_host  # noqa: E402


@dataclass
class Row:
    """One way of serving the same weights: a line of the table per concurrency."""

    label: str
    dtype: str = "float32"
    quantize: str = "none"
    config: dict = field(default_factory=dict)  # EngineConfig fields
    draft: Callable[[str, str], GPT] | None = None  # (checkpoint dir, device) -> draft model


ROWS = {
    "fp32": Row("fp32"),
    "bf16": Row("bf16", dtype="bfloat16"),
    "int8": Row("int8", quantize="int8"),  # float32 activations, as `--quantize int8` alone
    "int8-bf16": Row("int8, bf16 act.", dtype="bfloat16", quantize="int8"),
}
DEFAULT_ROWS = "fp32,bf16,int8,int8-bf16"


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# SmolLM2-135M's shape: 30 layers, 576 wide, 9 query and 3 KV heads, vocab 49152, tied embeddings
SMOLLM2_SHAPE = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
    rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
)  # fmt: skip


def hf_model(args):
    torch.manual_seed(0)
    if args.arch == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(**SMOLLM2_SHAPE)).eval()
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    return GPT2LMHeadModel(cfg).eval()


def write_filler_tokenizer(directory: str, vocab_size: int) -> None:
    """A byte-level tokenizer.json with `vocab_size` ids for a random Llama (the last one its end
    token): the engine needs a tokenizer to stream text; the ids are what is timed."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    while len(vocab) < vocab_size - 1:
        vocab[f"tok{len(vocab)}"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|end|>"])
    tok.save(f"{directory}/tokenizer.json")
    config = {"eos_token": "<|end|>"}
    Path(directory, "tokenizer_config.json").write_text(json.dumps(config))


def time_hf(hf, prompt: torch.Tensor, new: int, device: str) -> tuple[float, list[int]]:
    mask = torch.ones_like(prompt)
    kw = dict(do_sample=False, pad_token_id=0, attention_mask=mask)
    with torch.no_grad():
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
        (engine.blocks, "prepare", timer.wrap(engine.blocks, "prepare", "cache bookkeeping")),
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
            if owner is engine.model or owner is engine.blocks:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
    parts = dict(timer.totals)
    parts["engine overhead (rest)"] = total - sum(parts.values())
    return {k: v / total for k, v in parts.items()}


@dataclass
class Served:
    """A row's engine and what is measured of it."""

    row: Row
    engine: Engine
    weight_bytes: int
    single_s: float = float("inf")
    round_s: list[float] = field(default_factory=list)  # its single-stream time in each round
    tokens: list[int] = field(default_factory=list)  # its single-stream greedy tokens
    rates: dict[int, float] = field(default_factory=dict)  # concurrency -> tokens/s
    breakdown: dict[str, float] = field(default_factory=dict)


def serve(row: Row, checkpoint: str, device: str, num_blocks: int) -> Served:
    """Load the checkpoint as `gptserve serve` would with the row's flags; build its engine."""
    loaded = load_for_inference(
        checkpoint, device=device, dtype=row.dtype, quantization=row.quantize
    )
    draft = None
    if row.draft is not None:
        draft = prepare_for_inference(row.draft(checkpoint, device), row.quantize)
    config = EngineConfig(max_num_seqs=32, kv_block_size=16, num_blocks=num_blocks, **row.config)
    engine = Engine(loaded.model, loaded.tokenizer, config, draft_model=draft)
    return Served(row, engine, loaded.weight_bytes)  # each matrix once, as served


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--rows", default=DEFAULT_ROWS, help=f"rows to run, of {', '.join(ROWS)}")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="one row: this dtype (--rows ignored)")
    p.add_argument("--quantize", choices=QUANTIZATIONS, help="one row: this quantization")
    p.add_argument(
        "--arch", default="gpt2", choices=("gpt2", "llama"),
        help="gpt2: GPT-2's shape from the size flags; llama: SmolLM2-135M's shape (GQA)",
    )  # fmt: skip
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--n-head", type=int, default=12)
    p.add_argument("--n-embd", type=int, default=768)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--rounds", type=int, default=3, help="single-stream runs per side (best kept)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--no-speculative", action="store_true", help="skip the speculative rows")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print_host()
    dev, new = args.device, args.new_tokens
    if args.dtype or args.quantize:
        dtype, method = args.dtype or "float32", args.quantize or "none"
        label = dtype if method == "none" else f"{method}, {dtype} act."
        rows = [Row(label, dtype=dtype, quantize=method)]
    else:
        unknown = [r for r in args.rows.split(",") if r not in ROWS]
        if unknown:
            p.error(f"unknown rows {', '.join(unknown)}; choose from {', '.join(ROWS)}")
        rows = [ROWS[r] for r in args.rows.split(",")]
    try:
        for row in rows:
            check_load(dev, row.dtype, row.quantize)
    except ModelLoadError as exc:
        p.exit(2, f"error: {exc}\n")

    retain_freed_memory()
    hf = hf_model(args)
    blocks_per_seq = -(-(args.prompt_len + new + 16) // 16)  # room for speculative guesses
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        if args.arch == "llama":
            write_filler_tokenizer(tmp, hf.config.vocab_size)
        n_params = load_checkpoint(tmp).num_params()
        served = [serve(row, tmp, dev, 32 * blocks_per_seq) for row in rows]
    hf = hf.to(device=dev)
    gen = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, hf.config.vocab_size - 1, (args.prompt_len,), generator=gen).tolist()
        for _ in range(32)
    ]
    hf_prompt = torch.tensor([prompts[0]], device=dev)
    with torch.no_grad():  # warm-up
        hf.generate(hf_prompt, max_new_tokens=4, min_new_tokens=4, do_sample=False,
                    pad_token_id=0, attention_mask=torch.ones_like(hf_prompt))  # fmt: skip
    for s in served:
        run_engine(s.engine, [prompts[0]], 4, dev)

    # single stream: every side in turn, each keeps its best; every figure is printed as it is
    # measured, and the table follows at the end
    print("\nas measured (tok/s):", flush=True)
    hf_s, hf_tokens = float("inf"), []
    for r in range(args.rounds):
        secs, hf_tokens = time_hf(hf, hf_prompt, new, dev)
        hf_s = min(hf_s, secs)
        print(f"  round {r + 1}  {'transformers generate() fp32':30}{new / secs:8.1f}", flush=True)
        for s in served:
            secs, out = run_engine(s.engine, prompts[:1], new, dev)
            s.single_s, s.tokens = min(s.single_s, secs), out["0"]
            s.round_s.append(secs)
            print(f"  round {r + 1}  {'gptserve ' + s.row.label + ' x1':30}{new / secs:8.1f}",
                  flush=True)  # fmt: skip
    concurrency = [int(x) for x in args.concurrency.split(",")]
    for s in served:
        s.rates[1] = new / s.single_s
        for c in concurrency:
            if c > 1:
                s.rates[c] = c * new / run_engine(s.engine, prompts[:c], new, dev)[0]
                print(f"  {'':9}{'gptserve ' + s.row.label + f' x{c}':30}{s.rates[c]:8.1f}",
                      flush=True)  # fmt: skip
        s.breakdown = step_breakdown(s.engine, prompts[0], new, dev)

    hf_rate = new / hf_s
    hf_bytes = 4 * n_params
    base = next((s for s in served if s.row.dtype == "float32" and s.row.quantize == "none"), None)
    print(
        f"\ndecode: {'SmolLM2-shaped' if args.arch == 'llama' else 'GPT-2'} "
        f"{n_params / 1e6:.0f}M random weights, {dev}, "
        f"{torch.get_num_threads()} threads, prompt {args.prompt_len}, {new} new tokens, greedy; "
        f"best of {args.rounds} alternating rounds for one stream"
    )
    print(f"{'':30}{'tok/s':>8}{'vs HF':>8}{'vs fp32':>9}{'weights MB':>12}{'GB/s':>7}")
    print(f"{'transformers generate() fp32':30}{hf_rate:8.1f}{1.0:8.2f}{'':9}"
          f"{hf_bytes / 1e6:12.0f}{hf_bytes * hf_rate / 1e9:7.1f}")  # fmt: skip
    for s in served:
        for c in concurrency:
            rate = s.rates[c]
            vs_fp32 = f"{rate / base.rates[c]:9.2f}" if base else f"{'':9}"
            if c == 1:
                size = f"{s.weight_bytes / 1e6:12.0f}{s.weight_bytes * rate / 1e9:7.1f}"
            else:
                size = f"{'':19}  ({rate / s.rates[1]:.1f}x its single stream)"
            print(f"{'gptserve ' + s.row.label + f' x{c}':30}{rate:8.1f}{rate / hf_rate:8.2f}"
                  f"{vs_fp32}{size}")  # fmt: skip
    if base is not None and args.rounds > 1:
        # each round runs every side back to back: a ratio within a round is spared the drift
        # between rounds that the best-of figures above may catch on one side and not another
        print(f"\nsingle stream against fp32 within each round (median, lowest-highest of "
              f"{args.rounds}):")  # fmt: skip
        for s in served:
            if s is not base:
                ratios = sorted(b / t for b, t in zip(base.round_s, s.round_s))
                print(f"  {s.row.label:28}{statistics.median(ratios):6.2f}x"
                      f"   ({ratios[0]:.2f}-{ratios[-1]:.2f})")  # fmt: skip
    print(f"\ngreedy tokens equal to transformers' (of {new}), single stream:")
    for s in served:
        print(f"  {s.row.label:28}{common_prefix(s.tokens, hf_tokens):6d}")
    print("\nwhere a single-stream request's time goes (prefill + decode steps):")
    parts = list(served[0].breakdown)
    print(f"  {'':28}" + "".join(f"{s.row.label[:16]:>18}" for s in served))
    for k in parts:
        print(f"  {k:28}" + "".join(f"{100 * s.breakdown.get(k, 0):16.1f} %" for s in served))
    if not args.no_speculative and dev == "cpu":
        speculative_rows(args.rounds)


if __name__ == "__main__":
    main()
