"""The speculative rows of `bench/decode.py`: one stream, plain decoding against n-gram (prompt
lookup) and draft-model speculation, on the bundled default model.

The table's other rows use random GPT-2 124M weights, whose guesses would mean nothing: a random
model neither quotes its prompt nor agrees with a draft. The default model is trained (on
Shakespeare), so it continues a passage it has seen in its prompt, as a real model does. Prompts
come from the held-out last 10 % of data/shakespeare.txt:

- "repeats": a passage, then its first tokens again (a quotation: the model goes on copying);
- "does not repeat": fresh text, decoded greedily (a 16M model still falls into loops of its own)
  and sampled at temperature 1 (seeded), where guesses are mostly wrong: the cost of trying.

The draft is the default model's first layer with its embeddings and head (no second checkpoint
ships with the project), which costs most of what the whole model does: the head, 50257 x 256,
is most of this model's weights.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

from gptserve.engine.engine import Engine, EngineConfig
from gptserve.engine.loader import prepare_for_inference
from gptserve.engine.sampler import SamplingParams
from gptserve.model import GPT, get_tokenizer, load_checkpoint
from gptserve.model.quantize import weight_bytes

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = REPO / "model" / "shakespeare"
CORPUS = REPO / "data" / "shakespeare.txt"
NEW_TOKENS = 128


@dataclass
class Case:
    label: str
    prompt: list[int]
    params: SamplingParams


@dataclass
class Side:
    label: str
    engine: Engine
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)  # case -> best
    steps: dict[str, int] = dataclasses.field(default_factory=dict)
    accepted: dict[str, float] = dataclasses.field(default_factory=dict)  # share of guesses


def cases() -> list[Case]:
    tok = get_tokenizer()
    text = CORPUS.read_text(encoding="utf-8")
    held = text[int(0.9 * len(text)) :]
    passage = tok.encode(held[2000:6000])[:96]
    fresh = tok.encode(held[9000:13000])[:112]
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, seed=7, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [
        Case("repeats, greedy", passage + passage[:16], greedy),
        Case("does not repeat, greedy", fresh, greedy),
        Case("does not repeat, sampled", fresh, sampled),
    ]


def first_layers(model: GPT, n: int) -> GPT:
    """A draft: the model's first n layers, its embeddings, final norm and head."""
    draft = GPT(dataclasses.replace(model.config, n_layer=n))
    keep = {
        k: v
        for k, v in model.state_dict().items()
        if not k.startswith("transformer.h.") or int(k.split(".")[2]) < n
    }
    draft.load_state_dict(keep)
    return draft.eval()


def decode(side: Side, case: Case) -> tuple[float, int, float]:
    """(seconds, engine steps, share of guesses accepted) for one request."""
    engine = side.engine
    spec = engine.speculator
    before = (spec.proposed_tokens, spec.accepted_tokens) if spec else (0, 0)
    engine.add_request("r", case.prompt, case.params)
    steps, t0 = 0, time.perf_counter()
    while engine.has_work():
        engine.step()
        steps += 1
    seconds = time.perf_counter() - t0
    if spec is None:
        return seconds, steps, float("nan")
    proposed, accepted = spec.proposed_tokens - before[0], spec.accepted_tokens - before[1]
    return seconds, steps, accepted / proposed if proposed else 0.0


def speculative_rows(rounds: int, num_tokens: int = 4) -> None:
    """Print the speculative table: every side in turn for each case, best of `rounds`."""
    tok = get_tokenizer()
    loaded = load_checkpoint(DEFAULT_MODEL)
    size = weight_bytes(loaded)

    def engine(config: EngineConfig, draft: GPT | None = None) -> Engine:
        model = prepare_for_inference(copy.deepcopy(loaded))  # swaps modules in place
        return Engine(model, tok, config, draft_model=draft)

    plain_config = EngineConfig(max_num_seqs=4)
    spec_config = dataclasses.replace(plain_config, num_speculative_tokens=num_tokens)
    draft = prepare_for_inference(first_layers(loaded, 1))
    sides = [
        Side("plain", engine(plain_config)),
        Side("ngram", engine(dataclasses.replace(spec_config, speculative="ngram"))),
        Side("draft", engine(dataclasses.replace(spec_config, speculative="draft"), draft)),
    ]
    all_cases = cases()
    for side in sides:  # warm-up
        decode(side, dataclasses.replace(all_cases[0], params=SamplingParams(max_tokens=4)))
    for _ in range(rounds):
        for case in all_cases:
            for side in sides:
                seconds, steps, accepted = decode(side, case)
                if seconds < side.seconds.get(case.label, float("inf")):
                    side.seconds[case.label] = seconds
                    side.steps[case.label] = steps
                    side.accepted[case.label] = accepted

    print(
        f"\nspeculative decoding: the bundled default model ({size / 1e6:.0f} MB of float32 "
        f"weights, trained), one stream, {NEW_TOKENS} new tokens, {num_tokens} guesses a step, "
        f"draft = its first layer; best of {rounds} alternating rounds"
    )
    print(f"{'':40}{'tok/s':>8}{'vs plain':>9}{'steps':>7}{'accepted':>10}{'GB/s':>7}")
    for case in all_cases:
        base = sides[0].seconds[case.label]
        for side in sides:
            secs = side.seconds[case.label]
            rate = NEW_TOKENS / secs
            accepted = side.accepted[case.label]
            share = "" if accepted != accepted else f"{100 * accepted:9.0f}%"
            print(
                f"{side.label + ', ' + case.label:40}{rate:8.1f}{base / secs:9.2f}"
                f"{side.steps[case.label]:7d}{share:>10}{size * rate / 1e9:7.1f}"
            )
