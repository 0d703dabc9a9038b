"""What `--int8-activations` costs in quality, and what it gains in speed, on a GGUF model.

    python bench/int8_activations.py                  # the bundled default model
    python bench/int8_activations.py --model FILE     # another GGUF file with int4 matrices

The oracle is the file's weights dequantized to float32 (`load_checkpoint(FILE)`, the model
transformers builds from the same file). Against it, the file served at its own bits (float32
rows, the default) and with `--int8-activations` (rows rounded to 8 bits per block of 32 before
each int4 product, as llama.cpp multiplies): each row of the table gives the share of positions
whose most likely next token is the oracle's ("top-1"), the perplexity and its change, over
--windows windows of --window tokens of data/shakespeare.txt spread over the text; then each
side's greedy tokens from --prompts prompts of 16 tokens, --new-tokens each, through the Engine,
against the oracle's (how many prompts equal it, the mean common start). Where llama-cpp-python
is installed (`pip install llama-cpp-python`), llama.cpp's own answers on the same file take a
row too: the departure llama.cpp's 8-bit rows bring. Last, the decode step's time at --streams
streams, both ways, same process.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.append(str(Path(__file__).resolve().parents[1]))

from gptserve.engine.engine import Engine, EngineConfig  # noqa: E402
from gptserve.engine.loader import int8_activations_on  # noqa: E402
from gptserve.engine.sampler import SamplingParams  # noqa: E402
from gptserve.model import load_checkpoint  # noqa: E402
from gptserve.model.cpu import optimize_for_cpu  # noqa: E402
from gptserve.model.known_models import resolve_model  # noqa: E402
from gptserve.model.quantize import keep_int8_kernel  # noqa: E402
from gptserve.model.tokenizers import load_tokenizer  # noqa: E402

from bench.host import print_host  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def windows(tokens: list[int], count: int, length: int) -> torch.Tensor:
    """`count` windows of `length` + 1 tokens spread evenly over `tokens`: (count, length + 1)."""
    step = (len(tokens) - length - 1) // max(count - 1, 1)
    return torch.tensor([tokens[i * step : i * step + length + 1] for i in range(count)])


def score(model: torch.nn.Module, data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each position's log-probabilities' argmax and its target's loss: (W, T) each."""
    top, losses = [], []
    with torch.no_grad():
        for w in data:  # one window at a time, (T + 1,)
            logits = model(w[None, :-1])[0].float()  # (T, V)
            top.append(logits.argmax(-1))
            losses.append(F.cross_entropy(logits, w[1:], reduction="none"))
    return torch.stack(top), torch.stack(losses)


def greedy(
    model: torch.nn.Module, tokenizer, prompts: list[list[int]], new: int
) -> list[list[int]]:
    """Each prompt's greedy tokens, all prompts in one batch."""
    engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=len(prompts)))
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    while engine.has_work():
        for event in engine.step():
            out[event.request_id] += event.token_ids
    return [out[str(i)] for i in range(len(prompts))]


def step_time(model: torch.nn.Module, tokenizer, streams: int, steps: int = 24) -> float:
    """Seconds a decode step of `streams` greedy streams takes (64-token prompts), best of 3."""
    engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=streams, prefix_caching=False))
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=4 * steps + 8, ignore_eos=True)
    for i in range(streams):
        prompt = torch.randint(0, model.config.vocab_size, (64,), generator=gen).tolist()
        engine.add_request(str(i), prompt, params)
    while engine.num_waiting:
        engine.step()
    for _ in range(4):
        engine.step()
    best = math.inf
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        best = min(best, (time.perf_counter() - start) / steps)
    return best


def llamacpp_rows(path: Path, data: torch.Tensor, prompts: list[list[int]], new: int):
    """llama.cpp's top-1 tokens and losses on `data` and its greedy tokens for `prompts`, through
    llama-cpp-python (2 threads); None where it is not installed."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(str(path), n_ctx=data.shape[1] + new + 16, n_threads=2, logits_all=True,
                verbose=False)  # fmt: skip
    top, losses = [], []
    for w in data:
        llm.reset()
        llm.eval(w[:-1].tolist())
        logits = torch.from_numpy(llm.scores[: data.shape[1] - 1].copy()).float()  # (T, V)
        top.append(logits.argmax(-1))
        losses.append(F.cross_entropy(logits, w[1:], reduction="none"))
    texts = []
    for prompt in prompts:
        llm.reset()
        llm.eval(prompt)
        tokens = []
        for _ in range(new):
            tokens.append(int(llm.scores[llm.n_tokens - 1].argmax()))
            llm.eval(tokens[-1:])
        texts.append(tokens)
    return torch.stack(top), torch.stack(losses), texts


def common_start(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="a GGUF file or a known model's name")
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--window", type=int, default=256, help="tokens a window scores")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--streams", type=int, default=16, help="the timed decode step's streams")
    args = p.parse_args()
    print_host()
    path = resolve_model(args.model)
    tokenizer = load_tokenizer("gguf", path)
    text = (REPO / "data" / "shakespeare.txt").read_text()
    chars = 400 * args.windows * args.window // 64 + 20000  # ~4 characters a token, with room
    tokens = tokenizer.encode(text[:chars])
    data = windows(tokens, args.windows, args.window)  # (W, T + 1)
    prompts = [w[:16].tolist() for w in windows(tokens, args.prompts, 16)]

    oracle = load_checkpoint(path).eval()  # float32, dequantized
    want_top, want_loss = score(oracle, data)
    want_text = greedy(oracle, tokenizer, prompts, args.new_tokens)
    del oracle
    served = {}
    for label, rows8 in (("own bits, float32 rows", False), ("own bits, 8-bit rows", True)):
        model = load_checkpoint(path, low_bit=True).eval()
        if rows8 and not int8_activations_on(model):
            sys.exit(f"{path.name} has no int4 products for 8-bit rows")
        served[label] = optimize_for_cpu(model)
        keep_int8_kernel(served[label])  # the int8 head's kernel at every row count, as decoding

    print(f"\n{path.name}: {args.windows} windows of {args.window} tokens, {args.prompts} "
          f"greedy prompts of {args.new_tokens} tokens, against float32 weights")  # fmt: skip
    print(f"{'':26}{'top-1 = fp32':>13}{'perplexity':>12}{'change':>9}{'greedy = fp32':>15}"
          f"{'common start':>14}")  # fmt: skip
    base = math.exp(want_loss.mean().item())
    print(f"{'float32 weights (oracle)':26}{1:13.2%}{base:12.3f}{'':>9}{'':>15}{'':>14}")
    rows = [(label, *score(model, data), greedy(model, tokenizer, prompts, args.new_tokens))
            for label, model in served.items()]  # fmt: skip
    if (theirs := llamacpp_rows(path, data, prompts, args.new_tokens)) is not None:
        rows.append(("llama.cpp (8-bit rows)", *theirs))
    for label, top, loss, texts in rows:
        same = sum(t == w for t, w in zip(texts, want_text))
        start = sum(common_start(t, w) for t, w in zip(texts, want_text)) / len(texts)
        ppl = math.exp(loss.mean().item())
        print(f"{label:26}{(top == want_top).float().mean().item():13.2%}{ppl:12.3f}"
              f"{ppl / base - 1:+9.2%}{f'{same}/{len(texts)}':>15}{start:14.1f}")  # fmt: skip
    times = {label: step_time(model, tokenizer, args.streams) for label, model in served.items()}
    first, second = times.values()
    print(f"\ndecode step at {args.streams} streams: float32 rows {first * 1e3:.2f} ms, "
          f"8-bit rows {second * 1e3:.2f} ms ({first / second:.2f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
