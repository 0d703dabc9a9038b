"""A tiny random transformers MistralForCausalLM with a sliding window of 8, saved and loaded by
our loader, generates through the engine, well past its window (prompt 20, 60 new tokens), the
greedy tokens and logprobs transformers gives (full forwards with its window mask), on the CPU
backend, the SDPA gather backend and Triton's paged kernel (interpreter)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gptserve.engine.engine import Engine, EngineConfig
from gptserve.engine.loader import prepare_for_inference
from gptserve.engine.sampler import SamplingParams
from gptserve.kernels import SdpaGatherBackend, TritonBackend
from gptserve.model import get_tokenizer, load_checkpoint

transformers = pytest.importorskip("transformers")

VOCAB = 256


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory):
    config = transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        sliding_window=8,
    )  # fmt: skip
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(config).eval()
    path = tmp_path_factory.mktemp("mistral")
    model.save_pretrained(path)
    return model, Path(path)


def _transformers_greedy(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    ids, lps = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
            ids.append(int(logp.argmax()))
            lps.append(float(logp[ids[-1]]))
    return ids[len(prompt) :], lps


def _engine_greedy(path: Path, prompt: list[int], n: int, block_size: int):
    model = prepare_for_inference(load_checkpoint(path))
    engine = Engine(model, get_tokenizer(), EngineConfig(kv_block_size=block_size, num_blocks=64))
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0)
    engine.add_request("r", prompt, params)
    tokens, lps = [], []
    while engine.has_work():
        for ev in engine.step():
            assert ev.error is None, ev.error
            tokens += ev.token_ids
            lps += [lp.logprob for lp in ev.logprobs]
    return tokens, lps


PROMPT = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(5)).tolist()


@pytest.fixture(scope="module")
def expected(mistral) -> tuple[list[int], list[float]]:
    return _transformers_greedy(mistral[0], PROMPT, 60)


@pytest.mark.parametrize("backend", ["cpu", "sdpa", "triton"])
def test_generation_past_the_window_matches_transformers(mistral, expected, backend, monkeypatch):
    path = mistral[1]
    n = 60 if backend != "triton" else 24  # the interpreter is slow: still 3 windows past
    if backend == "sdpa":
        monkeypatch.setattr("gptserve.kernels.paged_kv.select_attention_backend",
                            lambda *a, **k: SdpaGatherBackend())  # fmt: skip
    elif backend == "triton":
        pytest.importorskip("triton", reason="triton is not installed")
        monkeypatch.setattr("gptserve.kernels.paged_kv.select_attention_backend",
                            lambda *a, **k: TritonBackend())  # fmt: skip
    want_tokens, want_lps = expected[0][:n], expected[1][:n]
    tokens, lps = _engine_greedy(path, PROMPT, n, block_size=4)
    assert tokens == want_tokens
    assert lps == pytest.approx(want_lps, abs=1e-4)
