"""CPU speed against llama.cpp in the same run: the same weights, threads, prompts and tokens.

    python bench/llamacpp.py                       # f32, f16, bf16 and q8_0 rows, 3 rounds
    python bench/llamacpp.py --rounds 5 --stat median
    python bench/llamacpp.py --formats f32,q8_0 --threads 1
    python bench/llamacpp.py --gguf smollm2-135m-instruct --streams 16   # one real file
    python bench/llamacpp.py --kv-cache-dtype float16   # gptserve's cache as llama.cpp's
    python bench/llamacpp.py --build-llamacpp      # build llama.cpp for this host if none is found
    python bench/llamacpp.py --python-llamacpp     # llama-cpp-python's build even beside a native one

llama.cpp runs as a native build for this host where one is found (`bench/llamacpp_native.py`:
`llama-bench` and `llama-batched-bench` in $LLAMACPP_BIN or the folder bench/build_llamacpp.sh
builds into; `--build-llamacpp` builds it when none is found, about 8 minutes on 2 cores), else
through `llama-cpp-python` (`pip install -e '.[bench]'`, which builds llama.cpp from source, not
always for the host's own instruction sets); without either the table holds gptserve's figures
only. The table says which build each row used.

Random GPT-2 124M weights, built as `bench/decode.py` builds them, are written as GGUF files
(architecture "gpt2", GPT-2's tokenizer in the metadata) with the `gguf` package in each format:
f32 against gptserve in float32; f16 and bf16 against gptserve in bfloat16 (bf16: the very
same weights; f16 is llama.cpp's usual half-precision format); q8_0 (int8 in blocks of 32, one
scale each) against gptserve's `--quantize int8` (int8 rows, one scale each, float32
activations). Both sides get the same thread count (torch.set_num_threads, llama.cpp's
n_threads and n_threads_batch), the same token ids, and produce as many tokens greedily:

- decode x1: one 64-token prompt, 128 new tokens. Against the native build, llama-bench's
  tg128 at depth 64 (`-d 64`: 128 tokens generated one at a time after a 64-token context,
  which it fills untimed), and gptserve's tokens/s likewise without the prefill: its 127 decode
  steps after the first token over the time from that token to the last (the same positions,
  64 to 191; llama-bench samples no tokens, gptserve's steps include its greedy sampling).
  Through llama-cpp-python both sides count the whole request (its prefill included), as
  bench/decode.py counts it;
- decode 32 streams: 32 different 64-token prompts, 128 new tokens each, all at once, the
  prompts' prefill included; gptserve's Engine batches them itself; the native build runs
  `llama-batched-bench -npp 64 -ntg 128 -npl 32` (tokens/s: 32 x 128 over its whole time);
  llama-cpp-python's `Llama` generates one sequence at a time, so that side drives the
  low-level batch API (`llama_batch` + `llama_decode` on a context with n_seq_max=32: prompts in
  512-token batches, then one decode call a step for all 32);
- prompt 64 and prompt 512: tokens/s of a prompt's prefill and its first token (llama-bench's
  pp64 and pp512: the prompt alone).

Every side starts from an empty cache each time (gptserve's prefix caching is off, llama.cpp's
memory is cleared). gptserve's KV cache has the model's dtype unless `--kv-cache-dtype` says
otherwise for its float32 models (`float16`: the cache llama.cpp keeps; bfloat16 models keep
their own). llama.cpp keeps its defaults otherwise (f16 KV cache, flash attention "auto",
512-token batches, the CPU backend's weight repacking). Each round runs every measurement on
both sides back to back, which side goes first alternating between rounds; the
table keeps each side's best (or median) and the ratio gptserve / llama.cpp (above 1: gptserve
is faster), in tokens per second and per CPU-second (all threads), which other processes' load
on a shared machine moves much less: gptserve's and llama-cpp-python's of this process; the
native tools' of their processes (the CPU time of a llama-bench run of 3 repetitions less that of
a run of 1, halved, so loading, warm-up and the depth's fill, done once a run, cancel;
llama-batched-bench's whole run, its loading included). With more than
one thread, threads that spin while they wait for one another count too, so `--threads 1`
gives the steadiest figures on a busy machine.

With `--gguf FILE` (or a known model's name, fetched once as `--model NAME` fetches it) both
sides load that one file instead: gptserve at the file's own bits, as `gptserve serve --model
FILE` serves it; prompts are random ids of its vocabulary. The table then also gives gptserve's
batched rate over llama.cpp's single stream.

The GGUF files are written by `gptserve.model.gguf.writer.write_gpt2_gguf` (what `gptserve export`
writes with); the llama.cpp driver here (`LlamaCpp`, `time_llamacpp`) is meant for other
benchmarks too.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))

from gptserve.engine.sampler import SamplingParams  # noqa: E402
from gptserve.kernels.paged_kv import cache_dtype  # noqa: E402
from gptserve.model import load_checkpoint  # noqa: E402
from gptserve.model.cpu.malloc_tuning import retain_freed_memory  # noqa: E402
from gptserve.model.dtypes import DTYPES  # noqa: E402
from gptserve.model.gguf.writer import write_gpt2_gguf  # noqa: E402
from gptserve.model.known_models import FetchError, resolve_model  # noqa: E402

from bench.decode import Row, hf_model, serve  # noqa: E402
from bench.host import print_host  # noqa: E402
from bench.llamacpp_native import NativeBuild, batched, build_native, find_native  # noqa: E402

INSTALL_HINT = "pip install -e '.[bench]' (llama-cpp-python builds llama.cpp from source)"


def missing_packages() -> list[str]:
    """The packages of the `bench` extra that are not installed."""
    wanted = {"llama-cpp-python": "llama_cpp", "gguf": "gguf"}
    return [name for name, module in wanted.items() if importlib.util.find_spec(module) is None]


# ---------------------------------------------------------------------------------------------
# llama.cpp


def _llama():
    """llama-cpp-python's low-level bindings, with llama.cpp's log cut to errors."""
    import llama_cpp

    global _LOG_CALLBACK
    if _LOG_CALLBACK is None:

        def log(level: int, text: bytes, user_data) -> None:
            if level == 3:  # GGML_LOG_LEVEL_ERROR
                print(text.decode("utf-8", "replace"), end="", file=sys.stderr, flush=True)

        _LOG_CALLBACK = llama_cpp.llama_log_callback(log)  # kept: llama.cpp holds the pointer
        llama_cpp.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()
    return llama_cpp


_LOG_CALLBACK = None


class LlamaCpp:
    """A GGUF model in llama.cpp with one context for up to `n_seq` sequences of `n_ctx_seq`
    tokens each, greedy, through llama-cpp-python's low-level API (`llama_decode` on batches
    that hold every sequence's next token)."""

    def __init__(self, gguf_path: str | Path, threads: int, n_seq: int = 1,
                 n_ctx_seq: int = 1024, n_batch: int = 512) -> None:  # fmt: skip
        ll = self._ll = _llama()
        self.n_seq, self.n_batch = n_seq, n_batch
        self._model = ll.llama_model_load_from_file(
            str(gguf_path).encode(), ll.llama_model_default_params()
        )
        if not self._model:
            raise RuntimeError(f"llama.cpp could not load {gguf_path}")
        params = ll.llama_context_default_params()
        params.n_ctx = n_seq * n_ctx_seq
        params.n_batch = params.n_ubatch = n_batch
        params.n_seq_max = n_seq
        params.n_threads = params.n_threads_batch = threads
        params.no_perf = True
        self._ctx = ll.llama_init_from_model(self._model, params)
        if not self._ctx:
            ll.llama_model_free(self._model)
            raise RuntimeError(f"llama.cpp could not make a context for {gguf_path}")
        self._memory = ll.llama_get_memory(self._ctx)
        self._batch = ll.llama_batch_init(max(n_batch, n_seq), 0, 1)
        self._sampler = ll.llama_sampler_chain_init(ll.llama_sampler_chain_default_params())
        ll.llama_sampler_chain_add(self._sampler, ll.llama_sampler_init_greedy())

    def close(self) -> None:
        if self._ctx:
            ll = self._ll
            ll.llama_sampler_free(self._sampler)
            ll.llama_batch_free(self._batch)
            ll.llama_free(self._ctx)
            ll.llama_model_free(self._model)
            self._ctx = None

    def __enter__(self) -> LlamaCpp:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> list[int]:
        """One llama_decode of (token, position, sequence, wants logits) entries; returns the
        greedy token after each entry that wants logits, in order."""
        b = self._batch
        for i, (token, pos, seq, logits) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, logits
            b.seq_id[i][0] = seq
        b.n_tokens = len(entries)
        rc = self._ll.llama_decode(self._ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        sample = self._ll.llama_sampler_sample
        return [sample(self._sampler, self._ctx, i) for i, e in enumerate(entries) if e[3]]

    def generate(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
        """Greedy `new_tokens` for each prompt (at most n_seq), from an empty cache; returns
        (seconds, tokens per prompt). Prompts go in batches of up to n_batch tokens, then every
        step decodes one token of every sequence in one call."""
        if len(prompts) > self.n_seq:
            raise ValueError(f"{len(prompts)} prompts for a context of {self.n_seq} sequences")
        self._ll.llama_memory_clear(self._memory, True)
        out: list[list[int]] = [[] for _ in prompts]
        t0 = time.perf_counter()
        pending = [(tok, pos, seq, pos == len(p) - 1)
                   for seq, p in enumerate(prompts) for pos, tok in enumerate(p)]  # fmt: skip
        for start in range(0, len(pending), self.n_batch):
            chunk = pending[start : start + self.n_batch]
            firsts = iter(self._decode(chunk))
            for _, _, seq, last in chunk:
                if last:
                    out[seq].append(next(firsts))
        for _ in range(new_tokens - 1):
            step = [(o[-1], len(p) + len(o) - 1, seq, True)
                    for seq, (p, o) in enumerate(zip(prompts, out))]  # fmt: skip
            for o, token in zip(out, self._decode(step)):
                o.append(token)
        return time.perf_counter() - t0, out


def time_llamacpp(gguf_path: str | Path, prompt_ids: list[int], new_tokens: int,
                  threads: int) -> tuple[float, list[int]]:  # fmt: skip
    """Seconds llama.cpp takes for one greedy request (its prefill included) after a warm-up,
    and the tokens it produced."""
    n_ctx = -(-(len(prompt_ids) + new_tokens) // 256) * 256
    with LlamaCpp(gguf_path, threads, n_seq=1, n_ctx_seq=n_ctx) as llm:
        llm.generate([prompt_ids], min(new_tokens, 4))
        secs, out = llm.generate([prompt_ids], new_tokens)
    return secs, out[0]


# ---------------------------------------------------------------------------------------------
# the native build's tools


def child_cpu() -> float:
    """CPU seconds of this process's finished children so far (user and system)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def llama_bench(build: NativeBuild, gguf: Path, threads: int, test: list[str],
                repetitions: int) -> tuple[float, float]:  # fmt: skip
    """One llama-bench test (`test`: its -p/-n/-d flags) of `repetitions` runs: its mean
    tokens/s, and the CPU seconds of the whole process (loading and warm-up included)."""
    cmd = [build.tool("llama-bench"), "-m", str(gguf), "-t", str(threads), *test,
           "-r", str(repetitions), "-o", "json"]  # fmt: skip
    cpu = child_cpu()
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    cpu = child_cpu() - cpu
    return float(json.loads(out)[0]["avg_ts"]), cpu


REPS = 3  # llama-bench runs of a measurement; its CPU time is that of REPS runs less one's


def native_side(build: NativeBuild, gguf: Path, threads: int) -> Callable:
    """llama.cpp's side by the native tools: decode x1 as llama-bench's tg at the prompt's
    depth, prompt rows as its pp, several streams by llama-batched-bench."""

    def pp(n: int) -> tuple[float, float]:  # tok/s, CPU seconds of one run
        rate, many = llama_bench(build, gguf, threads, ["-p", str(n), "-n", "0"], REPS)
        _, one = llama_bench(build, gguf, threads, ["-p", str(n), "-n", "0"], 1)
        return rate, (many - one) / (REPS - 1)

    def run(measure: str, prompts: list[list[int]], new: int) -> Timing | None:
        if measure == "warm-up":
            return None
        depth = len(prompts[0])
        if measure == "decode x1":
            test = ["-p", "0", "-n", str(new), "-d", str(depth)]
            rate, many = llama_bench(build, gguf, threads, test, REPS)
            _, one = llama_bench(build, gguf, threads, test, 1)
            cpu = (many - one) / (REPS - 1)  # the depth is filled once a run, before the reps
            return Timing(rate, new / cpu if cpu > 0 else None, "llama-bench")
        if measure.startswith("decode"):
            cpu = child_cpu()
            secs = batched(build, gguf, threads, len(prompts), depth, new)
            cpu = child_cpu() - cpu
            tokens = len(prompts) * new
            return Timing(tokens / secs, tokens / cpu, "llama-batched-bench")
        rate, cpu = pp(depth)
        return Timing(rate, depth / cpu if cpu > 0 else None, "llama-bench")

    return run


# ---------------------------------------------------------------------------------------------
# the race

# llama.cpp format -> (gptserve's dtype, quantization, its label)
PAIRS = {
    "f32": ("float32", "none", "float32"),
    "f16": ("bfloat16", "none", "bfloat16"),
    "bf16": ("bfloat16", "none", "bfloat16"),
    "q8_0": ("float32", "int8", "--quantize int8"),
}


@dataclass
class Timing:
    """One side's measurement: tokens/s, tokens per CPU-second (None: unknown), the llama.cpp
    build that ran it (empty: gptserve), decode x1's greedy tokens where known."""

    rate: float
    cpu_rate: float | None
    build: str = ""
    tokens: list[int] | None = None


Side = Callable[[str, list[list[int]], int], "Timing | None"]


@dataclass
class Pair:
    fmt: str
    gptserve: Side
    llama: Side | None
    sizes: tuple[int, int]  # bytes of the weights: gptserve's as served, the GGUF file
    rates: dict[tuple[str, str], list[float]] = field(default_factory=dict)  # (side, measure)
    cpu_rates: dict[tuple[str, str], list[float]] = field(default_factory=dict)  # per CPU-second
    builds: dict[str, str] = field(default_factory=dict)  # measure -> llama.cpp's build
    tokens: dict[str, list[int]] = field(default_factory=dict)  # side -> decode x1 tokens
    vocab_size: int = 50257  # the prompts' ids are drawn below it


def run_engine_timed(engine, prompts: list[list[int]], new: int) -> tuple[list[float], dict]:
    """Greedy `new` tokens for every prompt at once; returns the wall and CPU (this process)
    clocks at the start, at the first token and at the end, and the tokens per request."""
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=new,
                                                     ignore_eos=True))  # fmt: skip
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    marks = [time.perf_counter(), time.process_time()]
    while engine.has_work():
        for ev in engine.step():
            out[ev.request_id].extend(ev.token_ids)
        if len(marks) == 2 and any(out.values()):
            marks += [time.perf_counter(), time.process_time()]
    return [*marks, time.perf_counter(), time.process_time()], out


def gptserve_side(engine, decode_after_prefill: bool) -> Side:
    """gptserve's side; `decode_after_prefill`: decode x1 counts the tokens after the first over
    the time after it (llama-bench's tg), else the whole request."""

    def run(measure: str, prompts: list[list[int]], new: int) -> Timing:
        (w0, c0, w1, c1, w2, c2), out = run_engine_timed(engine, prompts, new)
        tokens = [out[str(i)] for i in range(len(prompts))]
        if measure == "decode x1" and decode_after_prefill:
            return Timing((new - 1) / (w2 - w1), (new - 1) / (c2 - c1), tokens=tokens[0])
        n = len(prompts) * (new if measure.startswith("decode") else len(prompts[0]))
        return Timing(n / (w2 - w0), n / (c2 - c0), tokens=tokens[0])

    return run


def llama_side(path: Path, threads: int, streams: int, seq_len: int, longest: int) -> Side:
    """llama.cpp through llama-cpp-python: one context for a single sequence (decode x1,
    prompts up to `longest` tokens), one for `streams` sequences of `seq_len` tokens; both read
    the same weights."""
    single = LlamaCpp(path, threads, n_seq=1, n_ctx_seq=-(-max(longest + 1, seq_len) // 256) * 256)
    multi = LlamaCpp(path, threads, n_seq=streams, n_ctx_seq=-(-seq_len // 256) * 256)
    import llama_cpp

    build = f"llama-cpp-python {llama_cpp.__version__}"

    def run(measure: str, prompts: list[list[int]], new: int) -> Timing:
        cpu = time.process_time()
        secs, out = (multi if len(prompts) > 1 else single).generate(prompts, new)
        cpu = time.process_time() - cpu  # every thread of this process
        n = len(prompts) * (new if measure.startswith("decode") else len(prompts[0]))
        return Timing(n / secs, n / cpu, build, out[0])

    return run


def measure_round(pair: Pair, first: str, work: dict[str, tuple[list[list[int]], int]]) -> None:
    sides = ["gptserve", "llama.cpp"] if pair.llama else ["gptserve"]
    if first != sides[0]:
        sides.reverse()
    for measure, (prompts, new) in work.items():
        for side in sides:
            run = pair.gptserve if side == "gptserve" else pair.llama
            got = run(measure, prompts, new)
            pair.rates.setdefault((side, measure), []).append(got.rate)
            if got.cpu_rate is not None:
                pair.cpu_rates.setdefault((side, measure), []).append(got.cpu_rate)
            if got.build:
                pair.builds[measure] = got.build
            if measure == "decode x1" and got.tokens is not None:
                pair.tokens[side] = got.tokens


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def llama_for(path: Path, threads: int, llama_args: tuple[int, int, int],
              rival: NativeBuild | str | None) -> Side | None:  # fmt: skip
    """llama.cpp's side on `path`: the native build's tools, llama-cpp-python ("python"), or
    none."""
    if isinstance(rival, NativeBuild):
        return native_side(rival, path, threads)
    return llama_side(path, threads, *llama_args) if rival == "python" else None


def random_gpt2_pairs(args, formats: list[str], tmp: str, blocks: int, threads: int,
                      llama_args: tuple[int, int, int],
                      rival: NativeBuild | str | None) -> list[Pair]:  # fmt: skip
    """One pair per format on random GPT-2 124M weights: gptserve loads the saved checkpoint in
    the format's dtype and quantization, llama.cpp the same weights written as GGUF."""
    hf = hf_model(argparse.Namespace(arch="gpt2", n_layer=12, n_head=12, n_embd=768))
    hf.save_pretrained(tmp)
    del hf
    reference = load_checkpoint(tmp)  # float32, as gptserve loads it
    gguf_dir = Path(args.keep_gguf or tmp)
    gguf_dir.mkdir(parents=True, exist_ok=True)
    pairs = []
    for fmt in formats:
        dtype, method, _ = PAIRS[fmt]
        row = Row(fmt, dtype=dtype, quantize=method, config=engine_config(args, dtype))
        served = serve(row, tmp, "cpu", blocks)
        llama, size = None, 0
        if rival is not None:
            t0 = time.perf_counter()
            path = write_gpt2_gguf(gguf_dir / f"gpt2-124m-random-{fmt}.gguf", reference, fmt)
            size = path.stat().st_size
            print(f"wrote {path.name} ({size / 1e6:.0f} MB) in "
                  f"{time.perf_counter() - t0:.1f} s", flush=True)  # fmt: skip
            llama = llama_for(path, threads, llama_args, rival)
        side = gptserve_side(served.engine, isinstance(rival, NativeBuild))
        pairs.append(Pair(fmt, side, llama, (served.weight_bytes, size)))
    return pairs


def engine_config(args: argparse.Namespace, dtype: str = "float32") -> dict:
    """gptserve's EngineConfig fields for weights in `dtype`: no prefix caching; the KV cache
    `--kv-cache-dtype` asks for where it goes with them (a 16-bit cache under float32 weights),
    else the weights' own."""
    try:
        kv = cache_dtype(DTYPES[dtype], DTYPES.get(args.kv_cache_dtype))
    except ValueError:
        kv = None  # the weights' own
    return {"prefix_caching": False, "kv_cache_dtype": kv}


def gguf_file_pair(args: argparse.Namespace, path: Path, blocks: int, threads: int,
                   llama_args: tuple[int, int, int], rival: NativeBuild | str | None) -> Pair:  # fmt: skip
    """Both sides on one GGUF file: gptserve serves it as `--model FILE` does (at its own bits
    on a CPU), llama.cpp loads it."""
    row = Row(path.name, config=engine_config(args))
    served = serve(row, str(path), "cpu", blocks)
    llama = llama_for(path, threads, llama_args, rival)
    size = path.stat().st_size
    sizes = (served.weight_bytes, size)
    vocab = served.engine.model.config.vocab_size
    side = gptserve_side(served.engine, isinstance(rival, NativeBuild))
    return Pair("file", side, llama, sizes, vocab_size=vocab)


def pick_rival(build: bool) -> NativeBuild | str | None:
    """llama.cpp's side: the native build (found, or built with `build`), else llama-cpp-python
    ("python") where it and `gguf` are installed, else None; says which."""
    native = find_native()
    if native is None and build:
        print("building llama.cpp for this host (bench/build_llamacpp.sh)...", flush=True)
        native = build_native()
    if native is not None:
        print(f"llama.cpp: {native.describe()}, {native.bin_dir}", flush=True)
        return native
    missing = missing_packages()
    if not missing:
        print("llama.cpp: no native build (set LLAMACPP_BIN or pass --build-llamacpp); "
              "llama-cpp-python's build serves", flush=True)  # fmt: skip
        return "python"
    print(f"no native llama.cpp build and {' and '.join(missing)} not installed: llama.cpp's "
          f"rows are skipped; pass --build-llamacpp or {INSTALL_HINT}", flush=True)  # fmt: skip
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--formats", default=",".join(PAIRS), help=f"of {', '.join(PAIRS)}")
    p.add_argument("--gguf", metavar="FILE|NAME",
                   help="race on this GGUF file, or a known model's name such as "
                   "smollm2-135m-instruct (fetched once), instead of random GPT-2 weights; "
                   "--formats is then ignored")  # fmt: skip
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--stat", choices=("best", "median"), default="best", help="per side")
    p.add_argument("--threads", type=int, default=None, help="both sides (default: torch's)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--streams", type=int, default=32, help="sequences of the batched decode")
    p.add_argument("--prompts", default="64,512", help="lengths of the prompt-processing rows")
    p.add_argument("--keep-gguf", metavar="DIR", help="also write the GGUF files to DIR")
    p.add_argument("--kv-cache-dtype", choices=("auto", *DTYPES), default="auto",
                   help="gptserve's KV cache (auto: the model's dtype; llama.cpp's is float16)")  # fmt: skip
    p.add_argument("--build-llamacpp", action="store_true",
                   help="build llama.cpp for this host when no native build is found (minutes)")  # fmt: skip
    p.add_argument("--python-llamacpp", action="store_true",
                   help="race llama-cpp-python's build even where a native one is found")  # fmt: skip
    args = p.parse_args()
    formats = args.formats.split(",")
    if any(f not in PAIRS for f in formats):
        p.error(f"--formats takes {', '.join(PAIRS)}")
    gguf_path = None
    if args.gguf:
        try:
            gguf_path = resolve_model(args.gguf)
        except FetchError as exc:
            p.error(f"--gguf {args.gguf}: {exc}")
        if gguf_path.suffix != ".gguf" or not gguf_path.is_file():
            p.error(f"--gguf {args.gguf}: not a GGUF file")
    if args.python_llamacpp and missing_packages():
        p.error(f"--python-llamacpp: {' and '.join(missing_packages())} not installed")
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    print_host()
    try:
        rival = "python" if args.python_llamacpp else pick_rival(args.build_llamacpp)
    except (OSError, subprocess.CalledProcessError) as exc:
        sys.exit(f"building llama.cpp failed: {exc}")
    native = isinstance(rival, NativeBuild)

    retain_freed_memory()
    new = args.new_tokens
    seq_len = args.prompt_len + new
    pp = [int(n) for n in args.prompts.split(",")]
    blocks = args.streams * -(-(seq_len + 16) // 16) + -(-(max(pp) + 16) // 16)
    llama_args = (args.streams, seq_len, max(pp))
    with tempfile.TemporaryDirectory() as tmp:
        if gguf_path is not None:
            pairs = [gguf_file_pair(args, gguf_path, blocks, threads, llama_args, rival)]
            title = f"{gguf_path.name} (the same file both sides)"
        else:
            pairs = random_gpt2_pairs(args, formats, tmp, blocks, threads, llama_args, rival)
            title = "GPT-2 124M random weights"
        vocab = pairs[0].vocab_size  # of the model loaded: the file is not read twice
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=gen).tolist()
                   for _ in range(args.streams)]  # fmt: skip
        work = {"decode x1": (prompts[:1], new), f"decode {args.streams} streams": (prompts, new)}
        for n in pp:  # each prompt-processing row its own random prompt
            work[f"prompt {n}"] = ([torch.randint(0, vocab, (n,), generator=gen).tolist()], 1)
        for pair in pairs:
            for side in (pair.gptserve, pair.llama):  # warm-up, one sequence and several
                for batch in (prompts[:1], prompts[:2]):
                    if side is not None:
                        side("warm-up", batch, 4)

        for r in range(args.rounds):
            first = "gptserve" if r % 2 == 0 else "llama.cpp"
            for pair in pairs:
                measure_round(pair, first, work)
                got = "  ".join(
                    f"{m} {pair.rates[('gptserve', m)][-1]:.1f}"
                    + (f"/{pair.rates[('llama.cpp', m)][-1]:.1f}" if pair.llama else "")
                    for m in work
                )
                print(f"round {r + 1} {pair.fmt}: {got}", flush=True)

    pick = max if args.stat == "best" else statistics.median
    kv = "the model's dtype" if args.kv_cache_dtype == "auto" else args.kv_cache_dtype
    print(
        f"\n{title}, {threads} threads both sides, prompt {args.prompt_len}, "
        f"{new} new tokens, greedy; {args.stat} of {args.rounds} alternating rounds; tok/s; "
        f"ratio = gptserve / llama.cpp; gptserve's KV cache: {kv} (a bfloat16 model's: its own), "
        "llama.cpp's: float16"
    )
    print("per CPU-second: tokens / CPU time (all threads) of gptserve's process and of "
          "llama.cpp's, which other processes' load moves less than wall-clock time")  # fmt: skip
    if rival is None:
        print(f"llama.cpp: none; pass --build-llamacpp or {INSTALL_HINT}")
    elif native:
        print(f"llama.cpp: {rival.describe()}; decode x1 = llama-bench's tg{new} at depth "
              f"{args.prompt_len} against gptserve's {new - 1} steps after its first token "
              "(prefill excluded both sides)")  # fmt: skip
    else:
        print("llama.cpp " + _llama().llama_print_system_info().decode().strip())
        print(f"llama.cpp, {args.streams} streams: llama-cpp-python's Llama runs one sequence at "
              f"a time; this drives llama_batch/llama_decode with n_seq_max={args.streams}")  # fmt: skip
    print(f"{'':44}{'tok/s':-^27}  {'tok per CPU-second':-^27}")
    columns = f"{'gptserve':>9}{'llama.cpp':>11}{'ratio':>7}"
    print(f"{'llama.cpp | gptserve':24}{'':20}{columns}  {columns}  llama.cpp build")
    for pair in pairs:
        label = f"{pair.fmt} | {PAIRS[pair.fmt][2]}" if pair.fmt in PAIRS else pair.fmt
        for i, m in enumerate(work):
            line = f"{label if i == 0 else '':24}{m:20}"
            for rates in (pair.rates, pair.cpu_rates):
                ours = pick(rates[("gptserve", m)])
                theirs = pick(rates[("llama.cpp", m)]) if ("llama.cpp", m) in rates else None
                rest = f"{theirs:11.1f}{ours / theirs:7.2f}" if theirs else f"{'-':>11}{'-':>7}"
                line += f"{ours:9.1f}{rest}  "
            print(line + pair.builds.get(m, "-"))
    batched_row = f"decode {args.streams} streams"
    for pair in (pair for pair in pairs if pair.llama):
        ours = pick(pair.rates[("gptserve", batched_row)])
        theirs = pick(pair.rates[("llama.cpp", "decode x1")])
        print(f"{pair.fmt}: gptserve's {args.streams} streams / llama.cpp's single stream, "
              f"tok/s: {ours / theirs:.2f}")  # fmt: skip
    # greedy tokens of decode x1 (of `new`): the two sides alike (llama-cpp-python's only: the
    # native tools report no tokens), and each side against its own f32 row (reduced precision
    # can change them: the top two logits of random weights are close)
    f32 = next((pair for pair in pairs if pair.fmt == "f32"), None)
    print(f"\n{'':8}{'weights MB':>11}{'GGUF MB':>9}   greedy tokens equal, decode x1, of {new}: "
          "gptserve = llama.cpp; gptserve = its f32, llama.cpp = its f32")  # fmt: skip
    for pair in pairs:
        gguf_mb = f"{pair.sizes[1] / 1e6:9.0f}" if pair.llama else f"{'-':>9}"
        sides = [s for s in ("gptserve", "llama.cpp") if s in pair.tokens]
        same = [str(common_prefix(*(pair.tokens[s] for s in sides)))] if len(sides) == 2 else ["-"]
        if f32 is not None and pair is not f32:
            same += [str(common_prefix(pair.tokens[s], f32.tokens[s])) if s in pair.tokens
                     else "-" for s in ("gptserve", "llama.cpp")]  # fmt: skip
        print(f"  {pair.fmt:6}{pair.sizes[0] / 1e6:11.0f}{gguf_mb}   {'; '.join(same)}")
    if hasattr(os, "getloadavg"):
        print(f"\nload average at the end: {os.getloadavg()[0]:.1f} (1 minute), "
              f"{os.getloadavg()[2]:.1f} (15 minutes)")  # fmt: skip


if __name__ == "__main__":
    main()
