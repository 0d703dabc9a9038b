"""SmolLM2-135M-Instruct's GGUF file at its own bits against its weights dequantized to float32.

    python bench/gguf_lowbit.py                 # memory, load, decode and quality rows
    python bench/gguf_lowbit.py --rounds 5 --threads 1

Both rows load the real file (`fetch_known_model`) as `gptserve serve` does: "own bits" with
`--quantize none` (Q4_1 layers through the int4 kernel, the Q8_0 table read from the file), and
"float32" with `--quantize dequantize` (today's float path). Each row reports the resident memory
a fresh process gains loading it (model and tokenizer) and the load time, measured in a
subprocess; single-stream greedy decode through the engine (a 64-token prompt, 128 new tokens,
the best of --rounds rounds that alternate the rows, so a slow spell on a shared machine falls
on both); and, over the first 512 tokens of data/shakespeare.txt, the top-1 agreement with the
float row and the loss.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))

from gptserve.engine.engine import Engine, EngineConfig  # noqa: E402
from gptserve.engine.loader import InferenceModel, load_for_inference  # noqa: E402
from gptserve.engine.sampler import SamplingParams  # noqa: E402
from gptserve.model.known_models import fetch_known_model  # noqa: E402

from bench.host import print_host  # noqa: E402

ROWS = {"own bits": "none", "float32": "dequantize"}  # label -> --quantize
REPO = Path(__file__).resolve().parents[1]
PROMPT_TOKENS, NEW_TOKENS, QUALITY_TOKENS = 64, 128, 512


def probe(path: Path, quantization: str) -> None:
    """In a fresh process: load one row and print what it cost as one JSON line."""
    import gc

    def rss() -> int:
        return int(Path("/proc/self/statm").read_text().split()[1]) * 4096

    gc.collect()
    before, t0 = rss(), time.perf_counter()
    loaded = load_for_inference(path, device="cpu", dtype="float32", quantization=quantization)
    seconds = time.perf_counter() - t0
    gc.collect()
    print(json.dumps({"rss": rss() - before, "weights": loaded.weight_bytes, "load_s": seconds}))


def measure_load(path: Path, quantization: str, threads: int) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--probe", quantization, "--threads", str(threads)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO)
    return json.loads(done.stdout.strip().splitlines()[-1])


def decode_seconds(
    engine: Engine, prompt: list[int], new_tokens: int = NEW_TOKENS
) -> tuple[float, list[int]]:
    """Seconds per new token after the first, and the tokens, for one greedy stream."""
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    engine.add_request(f"r{time.perf_counter_ns()}", prompt, params)
    tokens: list[int] = []
    start = None
    while engine.has_work():
        for event in engine.step():
            tokens.extend(event.token_ids)
        if start is None:  # the prefill step gave the first token
            start = time.perf_counter()
    return (time.perf_counter() - start) / (len(tokens) - 1), tokens


def quality(loaded: InferenceModel, ids: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Logits (T, V) over `ids` (1, T + 1) and the loss of its next tokens."""
    with torch.no_grad():
        logits = loaded.model(ids[:, :-1])[0].float()
    return logits, torch.nn.functional.cross_entropy(logits, ids[0, 1:]).item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--no-quality", action="store_true", help="skip the agreement and loss rows")
    p.add_argument("--probe", help=argparse.SUPPRESS)  # the subprocess measuring one row's load
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    path = fetch_known_model("smollm2-135m-instruct")
    if args.probe:
        probe(path, args.probe)
        return
    print_host()
    size = path.stat().st_size
    print(f"{path.name}: {size / 1e6:.0f} MB")
    loads = {label: measure_load(path, q, args.threads) for label, q in ROWS.items()}
    served = {label: load_for_inference(path, device="cpu", quantization=q) for label, q in ROWS.items()}  # fmt: skip
    engines = {
        label: Engine(s.model, s.tokenizer, EngineConfig(max_num_seqs=1, kv_block_size=16))
        for label, s in served.items()
    }
    text = (REPO / "data" / "shakespeare.txt").read_text()[:20000]
    tokens = served["own bits"].tokenizer.encode(text)
    best = {label: float("inf") for label in ROWS}
    outputs: dict[str, list[int]] = {}
    for _ in range(args.rounds):
        for label, engine in engines.items():
            seconds, outputs[label] = decode_seconds(engine, tokens[:PROMPT_TOKENS])
            best[label] = min(best[label], seconds)
    print(f"{'row':10} {'resident MB':>12} {'x file':>7} {'weights MB':>11} {'load s':>7} "
          f"{'ms/token':>9} {'tokens/s':>9} {'x float32':>10}")  # fmt: skip
    for label in ROWS:
        m = loads[label]
        print(
            f"{label:10} {m['rss'] / 1e6:12.0f} {m['rss'] / size:7.2f} {m['weights'] / 1e6:11.0f} "
            f"{m['load_s']:7.1f} {best[label] * 1e3:9.1f} {1 / best[label]:9.1f} "
            f"{best['float32'] / best[label]:10.2f}"
        )
    same = next(
        (i for i, (a, b) in enumerate(zip(*outputs.values())) if a != b), len(outputs["float32"])
    )
    print(f"greedy tokens identical for the first {same} of {NEW_TOKENS}")
    if args.no_quality:
        return
    ids = torch.tensor([tokens[: QUALITY_TOKENS + 1]])
    (low, low_loss), (ref, ref_loss) = (quality(served[label], ids) for label in ROWS)
    agreement = (low.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(
        f"first {QUALITY_TOKENS} tokens of data/shakespeare.txt: top-1 agreement {agreement:.4f}; "
        f"loss {low_loss:.4f} own bits, {ref_loss:.4f} float32 "
        f"({(low_loss - ref_loss) / ref_loss:+.2%})"
    )


if __name__ == "__main__":
    main()
