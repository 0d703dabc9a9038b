"""`--batch-invariant` on the models the server ships: the default SmolLM2-135M-Instruct file (at
its own bits, whose decode and prefill steps take the one-call layers; in bfloat16; with
`--quantize int8`) and the bundled shakespeare model (float32, bfloat16, int8), loaded as the
server loads them.

A seeded sampled chat request runs alone on a fresh engine, then on the same engine among 15
other chat requests (its prompt now cached but for its last block, theirs sharing the chat
template's system prompt with it: the step that finishes its prompt holds their prompts too),
then on a fresh engine that takes 48 tokens a step, the others queued over its first steps (its
prompt cut into chunks beside their decodes and chunks). Its tokens and logprobs must be equal
to the bit each time. Before `kernels.cpu.row_invariant`, the step that held other prompts over
the shared system prompt scored them by the cascade and moved the default model's first token
by 0.06 in logprob in bfloat16 (docs/RELIABILITY.md, "Batch invariance").
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from gptserve.engine.engine import Engine, EngineConfig
from gptserve.engine.loader import load_for_inference
from gptserve.engine.sampler import SamplingParams
from gptserve.model import SHAKESPEARE_DIR
from gptserve.model.known_models import DEFAULT_MODEL_NAME, fetch_known_model
from gptserve.server.chat.templates import load_chat_format

SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=24, logprobs=2)
TOPICS = ["a cat", "the moon", "taxes", "spring rain", "Rome", "bread", "a long road",
          "a lighthouse", "winter", "a violin", "the desert", "trains", "an old friend",
          "coffee", "a broken clock"]  # fmt: skip


@pytest.fixture(scope="module")
def default_model() -> Path:
    return fetch_known_model(DEFAULT_MODEL_NAME)


FORMATS = [
    pytest.param("default", "float32", "none", id="default-own-bits"),
    pytest.param("default", "bfloat16", "none", id="default-bf16"),
    pytest.param("default", "float32", "int8", id="default-int8"),
    pytest.param("shakespeare", "float32", "none", id="shakespeare-fp32"),
    pytest.param("shakespeare", "bfloat16", "none", id="shakespeare-bf16"),
    pytest.param("shakespeare", "bfloat16", "int8", id="shakespeare-int8-bf16"),
]


@pytest.mark.parametrize("model, dtype, quantization", FORMATS)
def test_a_seeded_chat_request_gets_its_bits_alone_and_among_others(
    request: pytest.FixtureRequest, model: str, dtype: str, quantization: str
) -> None:
    path = request.getfixturevalue("default_model") if model == "default" else SHAKESPEARE_DIR
    loaded = load_for_inference(
        path, device="cpu", dtype=dtype, quantization=quantization, batch_invariant=True
    )
    prompts = _chat_prompts(loaded, path)
    seeded, others = prompts[0], _others(prompts[1:])

    def engine(max_batch_tokens: int) -> Engine:
        config = EngineConfig(max_batch_tokens=max_batch_tokens, batch_invariant=True)
        return Engine(loaded.model, loaded.tokenizer, config)

    shared = engine(512)
    alone = _generate(shared, seeded, [], per_step=1)
    assert len(alone[0]) == SEEDED.max_tokens and len(set(alone[0])) > 5  # sampled text
    assert _generate(shared, seeded, others, per_step=len(others)) == alone
    assert _generate(engine(48), seeded, others, per_step=3) == alone


def _chat_prompts(loaded, path: Path) -> list[list[int]]:
    """The seeded request's chat prompt, then the others', as the chat endpoint renders them."""
    fmt = load_chat_format(path, loaded.tokenizer)
    rng = random.Random(0)
    texts = ["Write a short poem about the sea at night."] + [
        f"Tell me about {topic}." + " Please be detailed." * rng.randrange(0, 12)
        for topic in TOPICS
    ]
    messages = ([{"role": "user", "content": text}] for text in texts)
    return [loaded.tokenizer.encode(fmt.render_messages(m)) for m in messages]


def _others(prompts: list[list[int]]) -> list[tuple[list[int], SamplingParams]]:
    """Greedy, sampled, top-p and seeded requests of 4-16 tokens."""
    rng = random.Random(1)
    kinds = [dict(temperature=0), dict(temperature=1.0, top_p=0.9), dict(temperature=0.7, seed=3)]
    return [
        (prompt, SamplingParams(max_tokens=rng.randrange(4, 17), **kinds[i % 3]))
        for i, prompt in enumerate(prompts)
    ]


def _generate(
    engine: Engine, prompt: list[int], others: list[tuple[list[int], SamplingParams]],
    per_step: int,
) -> tuple[list[int], list[float]]:  # fmt: skip
    """The seeded request's tokens and logprobs (its own and its alternatives'), queued in the
    middle of `others`, `per_step` requests added before each step."""
    half = len(others) // 2
    queue = [(f"b{i}", p, sp) for i, (p, sp) in enumerate(others[:half])]
    queue += [("seeded", prompt, SEEDED)]
    queue += [(f"a{i}", p, sp) for i, (p, sp) in enumerate(others[half:])]
    tokens: list[int] = []
    logprobs: list[float] = []
    for _ in range(1000):  # bounded: every request ends within its max_tokens
        for request_id, p, sp in queue[:per_step]:
            engine.add_request(request_id, p, sp)
        queue = queue[per_step:]
        if not queue and not engine.has_work():
            break
        for ev in engine.step():
            assert ev.error is None
            if ev.request_id == "seeded":
                tokens += ev.token_ids
                logprobs += [lp.logprob for lp in ev.logprobs]
                logprobs += [alt for lp in ev.logprobs for _, alt in lp.top]
    return tokens, logprobs
