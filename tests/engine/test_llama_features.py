"""The engine's features on a Llama-shaped model with a Hugging Face tokenizer: continuous
batching, prefix caching, structured output, n-gram speculation, logprobs, stop strings, and
bfloat16 and int8 weights."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from gptserve.engine.engine import Engine, EngineConfig
from gptserve.engine.grammar import compile_constraint
from gptserve.engine.loader import prepare_for_inference
from gptserve.engine.sampler import SamplingParams
from gptserve.model import GPT, ModelConfig
from gptserve.model.tokenizers import HFTokenizer

from tests.conftest import byte_level_bpe

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory, shakespeare_path: Path) -> HFTokenizer:
    """A small byte-level BPE with ChatML's special tokens, as SmolLM2 and Qwen have."""
    text = shakespeare_path.read_text(encoding="utf-8")[:100_000]
    chunks = [text[i : i + 2000] for i in range(0, len(text), 2000)]
    rust = byte_level_bpe(chunks, 512, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    directory = tmp_path_factory.mktemp("tok")
    rust.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    return HFTokenizer.from_directory(directory)


@pytest.fixture(scope="module", params=[1, 2], ids=["mha", "gqa"])
def model(request: pytest.FixtureRequest, tok: HFTokenizer) -> GPT:
    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=tok.vocab_size, block_size=256, n_layer=2, n_head=4, n_embd=64,
        n_kv_head=4 // request.param, intermediate_size=96, bias=False, tie_embeddings=False,
        pos_encoding="rotary", norm="rmsnorm", activation="swiglu", rope_theta=10000.0,
        tokenizer="hf",
    )  # fmt: skip
    return GPT(config).eval()


def run(engine: Engine) -> dict:
    out: dict = {}
    for _ in range(10_000):
        if not engine.has_work():
            return out
        for ev in engine.step():
            out.setdefault(ev.request_id, []).append(ev)
    raise AssertionError("engine did not finish")


def greedy_reference(model: GPT, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt) :]


def text_of(events) -> str:
    return "".join(ev.text for ev in events)


def token_ids(events) -> list[int]:
    return [t for ev in events for t in ev.token_ids]


PROMPTS = ["To be, or not to be", "ROMEO:", "What light through yonder window breaks? " * 3]


def test_batched_greedy_matches_the_full_forward(model: GPT, tok: HFTokenizer) -> None:
    engine = Engine(model, tok, EngineConfig(kv_block_size=8, max_batch_tokens=32))
    prompts = [tok.encode(p) for p in PROMPTS]
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, SamplingParams(max_tokens=24, **GREEDY))
    out = run(engine)
    for i, ids in enumerate(prompts):
        assert token_ids(out[str(i)]) == greedy_reference(model, ids, 24)
        assert text_of(out[str(i)]) == tok.decode(token_ids(out[str(i)]))


def test_prefix_caching_and_ngram_speculation_keep_the_output(model: GPT, tok: HFTokenizer) -> None:
    prompt = tok.encode("the king the king the king the king, and the queen " * 4)
    outputs = []
    for config in (
        EngineConfig(kv_block_size=8, prefix_caching=False),
        EngineConfig(kv_block_size=8),
        EngineConfig(kv_block_size=8, speculative="ngram"),
    ):
        engine = Engine(model, tok, config)
        for wave in range(2):  # the second wave finds the first's blocks cached
            engine.add_request(f"w{wave}", prompt, SamplingParams(max_tokens=20, **GREEDY))
            outputs.append(token_ids(run(engine)[f"w{wave}"]))
    assert all(o == outputs[0] for o in outputs)


def test_structured_output_and_logprobs(model: GPT, tok: HFTokenizer) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    engine = Engine(model, tok, EngineConfig(kv_block_size=8))
    params = SamplingParams(temperature=0.9, seed=1, max_tokens=60, logprobs=2)
    params.constraint = compile_constraint("json", schema, tok, vocab_size=model.config.vocab_size)
    engine.add_request("j", tok.encode("<|im_start|>user\nA person?<|im_end|>\n"), params)
    events = run(engine)["j"]
    value = json.loads(text_of(events))
    assert set(value) == {"name", "age"} and isinstance(value["age"], int)
    lps = [lp for ev in events for lp in ev.logprobs]
    assert lps and all(lp.logprob <= 0 and len(lp.top) == 2 for lp in lps)


def test_stop_strings_and_end_tokens(model: GPT, tok: HFTokenizer) -> None:
    engine = Engine(model, tok, EngineConfig(kv_block_size=8))
    prompt = tok.encode(PROMPTS[0])
    free = greedy_reference(model, prompt, 16)
    cut = tok.decode(free)[3:6]  # a stop string inside the greedy text
    engine.add_request("s", prompt, SamplingParams(max_tokens=16, stop=[cut], **GREEDY))
    events = run(engine)["s"]
    assert events[-1].finish_reason == "stop" and cut not in text_of(events)
    end = free[4]  # that token as an end token: generation stops before its text
    engine.add_request("e", prompt, SamplingParams(max_tokens=16, stop_token_ids=[end], **GREEDY))
    events = run(engine)["e"]
    assert token_ids(events)[-1] == end and events[-1].finish_reason == "stop"


def test_any_of_the_models_end_tokens_ends_a_generation(
    model: GPT, tok: HFTokenizer, tmp_path: Path
) -> None:
    """generation_config.json's eos_token_id list: each id ends a turn (Llama 3's <|eot_id|>)."""
    prompt = tok.encode(PROMPTS[1])
    free = greedy_reference(model, prompt, 12)
    end = free[5]
    directory = tmp_path / "tok"
    directory.mkdir()
    tok._tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, end]}))
    ends_early = HFTokenizer.from_directory(directory)
    assert ends_early.eos_token_ids == [2, end]
    engine = Engine(model, ends_early, EngineConfig(kv_block_size=8))
    engine.add_request("x", prompt, SamplingParams(temperature=0, max_tokens=12))
    events = run(engine)["x"]
    assert token_ids(events) == free[: free.index(end) + 1]
    assert events[-1].finish_reason == "stop"
    assert text_of(events) == tok.decode(free[: free.index(end)])


@pytest.mark.parametrize(
    "dtype, quantization",
    [(torch.bfloat16, "none"), (torch.float32, "int8"), (torch.bfloat16, "int8")],
    ids=["bf16", "int8", "int8-bf16"],
)
def test_reduced_precision_batches_llama_shapes(
    model: GPT, tok: HFTokenizer, dtype: torch.dtype, quantization: str
) -> None:
    """`--dtype bfloat16` and `--quantize int8` serve a Llama-shaped model with grouped-query
    attention as loaded for the server (CPU wing included). Rounding may move near-ties, so each
    generated token is checked against the same prepared model's full forward over the text so
    far: it must be that forward's best token or within rounding of it."""
    prepared = prepare_for_inference(copy.deepcopy(model).to(dtype), quantization)
    engine = Engine(prepared, tok, EngineConfig(kv_block_size=8, max_batch_tokens=32))
    prompts = [tok.encode(p) for p in PROMPTS]
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, SamplingParams(max_tokens=16, **GREEDY))
    out = run(engine)
    slack = 0.05 if dtype == torch.bfloat16 else 0.02  # of logits that span about 1
    for i, ids in enumerate(prompts):
        got = token_ids(out[str(i)])
        assert len(got) == 16
        with torch.no_grad():
            logits = prepared(torch.tensor([ids + got]))[0, len(ids) - 1 : -1].float()  # (16, V)
        chosen = logits.gather(1, torch.tensor(got)[:, None])[:, 0]
        assert (logits.max(-1).values - chosen).max().item() <= slack
        assert (chosen == logits.max(-1).values).float().mean().item() >= 0.75
