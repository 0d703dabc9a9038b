"""What bfloat16 and int8 weights cost in quality: validation loss and greedy text against float32.

    python bench/precision_quality.py                 # the bundled default model
    python bench/precision_quality.py --model DIR     # a checkpoint of ours or a GPT-2 directory

Each format is loaded as `gptserve serve --dtype ... --quantize ...` loads it. The loss is the
mean cross-entropy, and "top-1 = fp32" the share of positions whose most likely next token is
float32's, over --windows windows of the model's context spread evenly over the corpus's
validation split (its last 10 %, split as training splits it). The greedy comparison takes
--prompts prompts of 32 tokens from that split, generates --new-tokens tokens greedily through
the Engine (all prompts in one batch), and counts the prompts whose tokens equal float32's, and
the mean length of the common start. The row "fp32, one at a time" is the floor: float32 itself,
each prompt alone, so its products run in other layouts and sum in another order.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.append(str(Path(__file__).resolve().parents[1]))

from gptserve.engine.engine import Engine, EngineConfig  # noqa: E402
from gptserve.engine.loader import prepare_for_inference  # noqa: E402
from gptserve.engine.sampler import SamplingParams  # noqa: E402
from gptserve.model import (  # noqa: E402
    GPT,
    SHAKESPEARE_DIR,  # noqa: E402
    ModelConfig,
    get_tokenizer,
    load_checkpoint,
)
from gptserve.model.cpu.malloc_tuning import retain_freed_memory  # noqa: E402
from gptserve.training.data import split_tokens, tokenize_cached  # noqa: E402

from bench.host import print_host  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
FORMATS = {  # label -> (dtype, quantization)
    "fp32": (torch.float32, "none"),
    "bf16": (torch.bfloat16, "none"),
    "int8": (torch.float32, "int8"),
    "int8, bf16 act.": (torch.bfloat16, "int8"),
}


def held_out(data: Path, block_size: int) -> np.ndarray:
    with tempfile.TemporaryDirectory() as tmp:
        path = tokenize_cached([data], Path(tmp), progress=False)
        tokens = np.fromfile(path, dtype=np.uint16)
    return split_tokens(tokens, block_size, 0.1)[1]


def evaluate(model: GPT, windows: torch.Tensor, batch: int = 8) -> tuple[float, torch.Tensor]:
    """Mean cross-entropy over the windows (B, T + 1), and the top-1 token at each position."""
    losses, top1 = [], []
    with torch.no_grad():
        for i in range(0, len(windows), batch):
            w = windows[i : i + batch]  # (B, T + 1)
            logits = model(w[:, :-1]).float()  # (B, T, V)
            losses.append(F.cross_entropy(logits.flatten(0, 1), w[:, 1:].flatten()).item())
            top1.append(logits.argmax(-1))  # (B, T)
    return float(np.mean(losses)), torch.cat(top1)


def greedy(model: GPT, prompts: list[list[int]], new: int, together: bool) -> list[list[int]]:
    """Greedy tokens for each prompt: all prompts in one batch, or one after another."""
    engine = Engine(model, get_tokenizer(model.config.tokenizer), EngineConfig(max_num_seqs=32))
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    ids = list(range(len(prompts)))
    for group in [ids] if together else [[i] for i in ids]:
        for i in group:
            engine.add_request(str(i), prompts[i], params)
        while engine.has_work():
            for ev in engine.step():
                out[ev.request_id] += ev.token_ids
    return [out[str(i)] for i in ids]


def common_start(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(SHAKESPEARE_DIR))
    p.add_argument("--data", default=str(REPO / "data" / "shakespeare.txt"))
    p.add_argument("--windows", type=int, default=64, help="validation windows of block_size")
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--new-tokens", type=int, default=32)
    args = p.parse_args()
    print_host()
    retain_freed_memory()
    config = ModelConfig.from_dict(json.loads((Path(args.model) / "config.json").read_text()))
    val = held_out(Path(args.data), config.block_size)
    T = config.block_size
    starts = np.linspace(0, len(val) - T - 1, args.windows).astype(np.int64)
    windows = torch.from_numpy(np.stack([val[s : s + T + 1] for s in starts]).astype(np.int64))
    prompt_starts = np.linspace(0, len(val) - 33, args.prompts).astype(np.int64)
    prompts = [val[s : s + 32].astype(np.int64).tolist() for s in prompt_starts]

    results = {}
    for label, (dtype, method) in FORMATS.items():
        t0 = time.perf_counter()
        model = prepare_for_inference(load_checkpoint(args.model, dtype=dtype), method)
        texts = greedy(model, prompts, args.new_tokens, together=True)
        results[label] = (*evaluate(model, windows), texts)
        if label == "fp32":  # the floor: the same weights, another batching, other roundings
            alone = greedy(model, prompts, args.new_tokens, together=False)
            results["fp32, one at a time"] = (*results[label][:2], alone)
        print(f"{label}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)

    ref_loss, ref_top1, ref_text = results["fp32"]
    print(
        f"\n{Path(args.model).name}: validation loss and top-1 tokens over {args.windows} x {T} "
        f"held-out tokens; greedy {args.new_tokens} tokens after {args.prompts} held-out prompts "
        "of 32 tokens"
    )
    print(f"{'':20}{'val loss':>10}{'vs fp32':>10}{'top-1 = fp32':>14}{'same text':>11}"
          f"{'mean common start':>19}")  # fmt: skip
    for label, (loss, top1, texts) in results.items():
        agree = (top1 == ref_top1).float().mean().item()
        same = sum(a == b for a, b in zip(texts, ref_text))
        start = np.mean([common_start(a, b) for a, b in zip(texts, ref_text)])
        print(
            f"{label:20}{loss:10.4f}{100 * (loss / ref_loss - 1):+9.3f}%{100 * agree:13.2f}%"
            f"{f'{same}/{len(texts)}':>11}{start:13.1f} / {args.new_tokens}"
        )


if __name__ == "__main__":
    main()
