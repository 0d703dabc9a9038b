"""A GGUF file of Q6_K (or Q5_K) matrices at their own bits against the same file as int8 rows.

    python bench/gguf_kquant.py                    # Q6_K, decode and memory rows
    python bench/gguf_kquant.py --kind Q5_K --rounds 5 --threads 1

The file is written once (`--out`, default under the system's temporary directory): a
Llama-shaped model whose widths are whole super-blocks (1024 wide, 8 layers, FFN 2816, 32000
tokens, an untied head), random weights rounded to `--kind` by `model.gguf.kquant_blocks.
quantize`, every matrix and the token table in that type, and a stand-in tokenizer. Two rows
load it as `gptserve serve` does (`load_for_inference`): "own bits", the file's super-blocks
through the compiled K-quant kernels (`model.kquant_linear.KQuantLinear`, today's path), and
"int8 rows", each matrix requantized to int8 rows with one scale each (`Int8Linear`, the path
before it, which serves now only where the compiled kernels are not built). Each row reports
the resident memory a fresh process gains loading it and the load time (in a subprocess), the
weights' bytes, single-stream greedy decode through the engine (a 64-token prompt, 128 new
tokens, the best of --rounds rounds alternating the rows), and the largest difference of its
logits over the prompt from the file's weights dequantized to float32. Last, what the compiled
kernels' absence would cost: one row through one of the file's FFN matrices, decoded by PyTorch
(`KQuantLinear(compiled=False)`) against PyTorch's int8 kernel on its int8 rows (what a model
loaded without the kernels runs), best of 20.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))

from gptserve.engine.engine import Engine, EngineConfig  # noqa: E402
from gptserve.engine.loader import InferenceModel, load_for_inference  # noqa: E402
from gptserve.model.gguf.kquant_blocks import quantize  # noqa: E402
from gptserve.model.kquant_linear import KQuantLinear  # noqa: E402
from gptserve.model.quantize import Int8Linear, quantize_rows  # noqa: E402

from bench.gguf_lowbit import decode_seconds  # noqa: E402
from bench.host import print_host  # noqa: E402

ROWS = ("own bits", "int8 rows")
HIDDEN, LAYERS, FFN, HEADS, KV_HEADS, VOCAB = 1024, 8, 2816, 16, 4, 32000
PROMPT_TOKENS = 64


def write_file(path: Path, kind: str) -> None:
    """The benchmark's GGUF file (module docstring)."""
    import gguf

    rng = np.random.default_rng(0)
    qtype = gguf.GGMLQuantizationType[kind]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(2048)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    byte_chars = [chr(c) for c in range(33, 127)]
    writer.add_token_list(byte_chars + [f"t{i}" for i in range(VOCAB - len(byte_chars) - 1)] + ["<|end|>"])  # fmt: skip
    writer.add_token_types([1] * (VOCAB - 1) + [3])
    writer.add_token_merges([])
    writer.add_eos_token_id(VOCAB - 1)

    def matrix(name: str, rows: int, cols: int) -> None:
        w = rng.standard_normal((rows, cols), dtype=np.float32) * 0.02
        writer.add_tensor(name, quantize(w, kind), raw_dtype=qtype)

    def norm(name: str) -> None:
        writer.add_tensor(name, np.ones(HIDDEN, dtype=np.float32))

    head_dim = HIDDEN // HEADS
    matrix("token_embd.weight", VOCAB, HIDDEN)
    for i in range(LAYERS):
        b = f"blk.{i}."
        norm(b + "attn_norm.weight")
        norm(b + "ffn_norm.weight")
        matrix(b + "attn_q.weight", HIDDEN, HIDDEN)
        matrix(b + "attn_k.weight", KV_HEADS * head_dim, HIDDEN)
        matrix(b + "attn_v.weight", KV_HEADS * head_dim, HIDDEN)
        matrix(b + "attn_output.weight", HIDDEN, HIDDEN)
        matrix(b + "ffn_gate.weight", FFN, HIDDEN)
        matrix(b + "ffn_up.weight", FFN, HIDDEN)
        matrix(b + "ffn_down.weight", HIDDEN, FFN)
    norm("output_norm.weight")
    matrix("output.weight", VOCAB, HIDDEN)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def load(path: Path, label: str) -> InferenceModel:
    """The file loaded as `label`'s row serves it."""
    import gptserve.model.gguf.quantized as quantized

    own = quantized.kquant_compiled
    if label == "int8 rows":  # the path taken where the compiled kernels are not built
        quantized.kquant_compiled = lambda: False
    try:
        return load_for_inference(path, device="cpu", dtype="float32")
    finally:
        quantized.kquant_compiled = own


def probe(path: Path, label: str) -> None:
    """In a fresh process: load one row and print what it cost as one JSON line."""
    import gc

    def rss() -> int:
        return int(Path("/proc/self/statm").read_text().split()[1]) * 4096

    import gguf  # noqa: F401 - libraries' code is not the model's memory
    import tokenizers  # noqa: F401

    gc.collect()
    before, t0 = rss(), time.perf_counter()
    loaded = load(path, label)
    seconds = time.perf_counter() - t0
    gc.collect()
    print(json.dumps({"rss": rss() - before, "weights": loaded.weight_bytes, "load_s": seconds}))


def measure_load(path: Path, label: str, threads: int) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--probe", label, "--out", str(path), "--threads", str(threads)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--kind", choices=["Q6_K", "Q5_K"], default="Q6_K")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--out", type=Path, help="the file (written if missing)")
    p.add_argument("--probe", help=argparse.SUPPRESS)  # the subprocess measuring one row's load
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    path = args.out or Path(tempfile.gettempdir()) / f"gptserve-bench-{args.kind}.gguf"
    if args.probe:
        probe(path, args.probe)
        return
    print_host()
    if not path.is_file():
        t0 = time.perf_counter()
        write_file(path, args.kind)
        print(f"wrote {path} in {time.perf_counter() - t0:.0f} s")
    size = path.stat().st_size
    print(f"{path.name}: {size / 1e6:.0f} MB, every matrix and the token table {args.kind}")
    loads = {label: measure_load(path, label, args.threads) for label in ROWS}
    served = {label: load(path, label) for label in ROWS}
    engines = {
        label: Engine(s.model, s.tokenizer, EngineConfig(max_num_seqs=1, kv_block_size=16))
        for label, s in served.items()
    }
    prompt = torch.randint(0, VOCAB - 1, (PROMPT_TOKENS,), generator=torch.Generator().manual_seed(0)).tolist()  # fmt: skip
    best = {label: float("inf") for label in ROWS}
    outputs: dict[str, list[int]] = {}
    for _ in range(args.rounds):
        for label, engine in engines.items():
            seconds, outputs[label] = decode_seconds(engine, prompt, args.new_tokens)
            best[label] = min(best[label], seconds)
    with torch.no_grad():
        floats = load_for_inference(path, device="cpu", dtype="float32", quantization="dequantize")
        ids = torch.tensor([prompt])
        want = floats.model(ids)[0]
        errors = {label: (s.model(ids)[0] - want).abs().max().item() for label, s in served.items()}
        del floats
    print(f"{'row':10} {'resident MB':>12} {'x file':>7} {'weights MB':>11} {'load s':>7} "
          f"{'ms/token':>9} {'tokens/s':>9} {'x int8':>7} {'max |logit - float32|':>22}")  # fmt: skip
    for label in ROWS:
        m = loads[label]
        print(
            f"{label:10} {m['rss'] / 1e6:12.0f} {m['rss'] / size:7.2f} {m['weights'] / 1e6:11.0f} "
            f"{m['load_s']:7.1f} {best[label] * 1e3:9.1f} {1 / best[label]:9.1f} "
            f"{best['int8 rows'] / best[label]:7.2f} {errors[label]:22.2e}"
        )
    same = next((i for i, (a, b) in enumerate(zip(*outputs.values())) if a != b), args.new_tokens)
    print(f"greedy tokens identical for the first {same} of {args.new_tokens}")
    fallback_row(served["own bits"])


def best_ms(module: torch.nn.Module, x: torch.Tensor, repeats: int = 20) -> float:
    module(x)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        module(x)
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def fallback_row(own: InferenceModel) -> None:
    """One row through the first FFN down matrix without the compiled kernels (docstring)."""
    held = own.model.transformer.h[0].mlp.c_proj
    pytorch = KQuantLinear(held.blocks, held.kind, held.in_features, compiled=False)
    int8 = Int8Linear.from_rows(*quantize_rows(held.weight_rows()), tiled=False)
    x = torch.randn(1, held.in_features, generator=torch.Generator().manual_seed(1))
    decoded, rows = best_ms(pytorch, x), best_ms(int8, x)
    print(
        f"without the compiled kernels, one row through a {held.out_features} x "
        f"{held.in_features} matrix: PyTorch decoding the {held.kind} blocks {decoded:.2f} ms, "
        f"PyTorch's int8 kernel on int8 rows {rows:.2f} ms ({decoded / rows:.0f}x)"
    )


if __name__ == "__main__":
    main()
