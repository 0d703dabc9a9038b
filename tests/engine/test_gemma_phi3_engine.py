"""Gemma 3 and Phi-3 checkpoints saved by transformers, loaded as the server loads them (the CPU
wing included), generate transformers' greedy tokens and logprobs through the engine: a batch
of prompts of mixed lengths over the paged KV cache, with prefix caching, past a sliding window
of 8 tokens (Gemma 3: on every other layer; Phi-3: on every layer; Phi-4-mini rotating part of
each head, through the one-call CPU layer as well)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gptserve.engine.engine import Engine, EngineConfig
from gptserve.engine.loader import load_for_inference
from gptserve.engine.sampler import SamplingParams

from tests.engine.test_llama_features import run
from tests.model.test_hf_gemma_phi3 import VOCAB, make
from tests.server.test_hf_models_served import save_word_tokenizer

pytest.importorskip("transformers")

NEW_TOKENS = 12
PROMPT_LENGTHS = (3, 11, 20, 30)
WINDOW = 8


def reference(model, prompt: list[int]) -> tuple[list[int], list[float]]:  # noqa: ANN001
    """transformers' greedy tokens and each one's logprob, one full forward per token."""
    ids, lps = list(prompt), []
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logprobs = model(torch.tensor([ids])).logits[0, -1].float().log_softmax(-1)
            ids.append(int(logprobs.argmax()))
            lps.append(float(logprobs[ids[-1]]))
    return ids[len(prompt) :], lps


@pytest.mark.parametrize(
    "kind", ["gemma3", "phi3", "phi3-longrope", "phi4-mini", "phi4-mini-longrope"]
)
def test_batched_greedy_tokens_and_logprobs_match_transformers(kind: str, tmp_path: Path) -> None:
    ref = make(kind, tmp_path, sliding_window=WINDOW)
    save_word_tokenizer(tmp_path)
    loaded = load_for_inference(tmp_path, device="cpu")
    assert WINDOW in loaded.model.config.layer_windows()
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    prompts.append(prompts[2][:15] + prompts[0])  # shares a cached prefix with the third
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(kv_block_size=8))
    for i, ids in enumerate(prompts):
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=1)
        engine.add_request(str(i), ids, params)
    out = run(engine)
    for i, ids in enumerate(prompts):
        tokens, lps = reference(ref, ids)
        events = out[str(i)]
        assert [t for ev in events for t in ev.token_ids] == tokens
        got = [lp.logprob for ev in events for lp in ev.logprobs]
        assert max(abs(a - b) for a, b in zip(got, lps)) < 1e-3


@pytest.mark.parametrize(
    "dtype, quantization",
    [(torch.bfloat16, "none"), (torch.float32, "int8")],
    ids=["bf16", "int8"],
)
def test_reduced_precision_gemma3_batches(
    dtype: torch.dtype, quantization: str, tmp_path: Path
) -> None:
    """`--dtype bfloat16` and `--quantize int8` serve Gemma 3 (CPU wing included): each generated
    token is the same prepared model's full-forward best or within rounding of it."""
    make("gemma3", tmp_path, sliding_window=WINDOW)
    save_word_tokenizer(tmp_path)
    loaded = load_for_inference(
        tmp_path, device="cpu", dtype=str(dtype)[6:], quantization=quantization
    )
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(kv_block_size=8))
    for i, ids in enumerate(prompts):
        engine.add_request(
            str(i), ids, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
        )
    out = run(engine)
    for i, ids in enumerate(prompts):
        got = [t for ev in out[str(i)] for t in ev.token_ids]
        with torch.no_grad():
            logits = loaded.model(torch.tensor([ids + got]))[0, len(ids) - 1 : -1].float()
        chosen = logits.gather(1, torch.tensor(got)[:, None])[:, 0]
        assert (logits.max(-1).values - chosen).max().item() <= 0.05  # of logits within 2
        assert (chosen == logits.max(-1).values).float().mean().item() >= 0.75
