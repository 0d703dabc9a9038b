"""Many LoRA adapters in one batch: each row's greedy tokens and logprobs are those of its own
adapter (our float adapter math: the adapter merged into a copy of the float weights), on the
CPU paged backend with the model optimized as the server does, on the SDPA gather backend and
on the Triton kernels (in the interpreter);
requests of an unloaded adapter finish first; no prefix block is shared across adapters."""

from __future__ import annotations

import copy

import pytest
import torch
from gptserve.engine.adapters import NOT_FOUND, SLOTS_FULL, AdapterError
from gptserve.engine.engine import Engine, EngineConfig
from gptserve.engine.loader import prepare_for_inference
from gptserve.engine.sampler import SamplingParams
from gptserve.kernels import SdpaGatherBackend
from gptserve.kernels.paged_kv import KVPools
from gptserve.model import GPT, ModelConfig
from gptserve.model.lora.batched import install_lora

from tests.lora_testing import greedy_with_logprobs, merged, random_adapter

N_TOKENS = 5
# 8 rows over 3 adapters and the base, interleaved
ROW_ADAPTERS = [None, "a", "b", "c", "a", None, "c", "b"]


def _config(kind: str, vocab: int) -> ModelConfig:
    if kind == "gpt2":
        return ModelConfig(vocab_size=vocab, n_layer=2, n_head=4, n_embd=64, block_size=128)
    return ModelConfig(
        vocab_size=vocab, block_size=128, n_layer=2, n_head=4, n_embd=64, n_kv_head=2,
        intermediate_size=96, bias=False, tie_embeddings=False, pos_encoding="rotary",
        norm="rmsnorm", activation="swiglu", tokenizer="hf",
    )  # fmt: skip


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def base(request: pytest.FixtureRequest, tok) -> GPT:
    torch.manual_seed(0)
    return GPT(_config(request.param, tok.vocab_size)).eval()


def _engine(
    model: GPT, tok, adapters, max_loras: int = 4, backend: str = "cpu-paged", **kw
) -> Engine:
    served = prepare_for_inference(copy.deepcopy(model))  # the CPU wing, as the server loads
    bank = install_lora(served, max_loras, 16)
    engine = Engine(served, tok, EngineConfig(kv_block_size=8, **kw), lora=bank)
    if backend != "cpu-paged":  # another attention backend than the CPU paged one
        if backend == "triton":
            pytest.importorskip("triton")
            from gptserve.kernels import TritonBackend

            attention = TritonBackend()
        else:
            attention = SdpaGatherBackend()
        pools = KVPools.for_model(served, engine.pools.num_blocks, 8, backend=attention)
        engine.pools = engine.runner.pools = pools
    for adapter in adapters:
        engine.adapters.load(adapter.name, adapter)
    return engine


def _run(engine: Engine) -> dict[str, list]:
    out: dict[str, list] = {}
    for _ in range(1000):
        if not engine.has_work():
            return out
        for ev in engine.step():
            assert ev.error is None, ev.error
            out.setdefault(ev.request_id, []).append(ev)
    raise AssertionError("the engine did not finish")


def _prompts(tok, n: int) -> list[list[int]]:
    words = ["To be, or not", "ROMEO:", "What light", "Once more unto", "Now is the winter"]
    return [tok.encode(words[i % len(words)] + " " * (i // len(words))) for i in range(n)]


def _params(lora: str | None) -> SamplingParams:
    return SamplingParams(
        max_tokens=N_TOKENS, temperature=0, ignore_eos=True, logprobs=0, lora=lora
    )


@pytest.mark.parametrize("backend", ["cpu-paged", "sdpa", "triton"])
def test_a_mixed_batch_gives_each_row_its_adapters_tokens(base: GPT, tok, backend: str) -> None:
    if backend == "triton" and base.config.activation != "swiglu":
        pytest.skip("the Triton interpreter is slow: one model (Llama-shaped) runs it")
    adapters = {n: random_adapter(base.config, n, seed=i) for i, n in enumerate("abc")}
    engine = _engine(base, tok, adapters.values(), backend=backend)
    prompts = _prompts(tok, len(ROW_ADAPTERS))
    for i, (ids, name) in enumerate(zip(prompts, ROW_ADAPTERS)):
        engine.add_request(str(i), ids, _params(name))
    out = _run(engine)
    oracles = {n: merged(base, adapters.get(n)) for n in (None, *adapters)}
    changed = 0
    for i, (ids, name) in enumerate(zip(prompts, ROW_ADAPTERS)):
        tokens = [t for ev in out[str(i)] for t in ev.token_ids]
        lps = [lp.logprob for ev in out[str(i)] for lp in ev.logprobs]
        want_tokens, want_lps = greedy_with_logprobs(oracles[name], ids, N_TOKENS)
        assert tokens == want_tokens, (i, name)
        assert lps == pytest.approx(want_lps, abs=2e-4), (i, name)
        changed += (
            name is not None and tokens != greedy_with_logprobs(oracles[None], ids, N_TOKENS)[0]
        )
    assert changed >= 4  # the adapters matter: most adapter rows differ from the base's tokens


def test_ngram_speculation_with_adapters_keeps_the_tokens(base: GPT, tok) -> None:
    adapter = random_adapter(base.config, "a", seed=3)
    prompt = tok.encode("the king the king the king the king, and the queen " * 2)
    outputs = []
    for speculative in (None, "ngram"):
        engine = _engine(base, tok, [adapter], speculative=speculative)
        engine.add_request("s", prompt, _params("a"))
        outputs.append([t for ev in _run(engine)["s"] for t in ev.token_ids])
    assert outputs[0] == outputs[1] == greedy_with_logprobs(merged(base, adapter), prompt, 5)[0]


def test_unloading_an_adapter_in_use_lets_its_requests_finish(base: GPT, tok) -> None:
    adapters = [random_adapter(base.config, n, seed=i) for i, n in enumerate("ab")]
    engine = _engine(base, tok, adapters, max_loras=2)
    prompt = _prompts(tok, 1)[0]
    engine.add_request("r", prompt, _params("a"))
    first = [t for ev in engine.step() for t in ev.token_ids]  # its prefill: a token
    engine.adapters.unload("a")
    with pytest.raises(AdapterError) as refused:  # new requests for it are refused at once
        engine.add_request("late", prompt, _params("a"))
    assert refused.value.code == NOT_FOUND
    with pytest.raises(AdapterError) as full:  # its slot is still in use
        engine.adapters.load("c", random_adapter(base.config, "c", seed=5))
    assert full.value.code == SLOTS_FULL
    tokens = first + [t for ev in _run(engine)["r"] for t in ev.token_ids]
    assert tokens == greedy_with_logprobs(merged(base, adapters[0]), prompt, N_TOKENS)[0]
    engine.adapters.load("c", random_adapter(base.config, "c", seed=5))  # the slot is free now


def test_no_prefix_block_is_shared_across_adapters(base: GPT, tok) -> None:
    adapters = [random_adapter(base.config, n, seed=i) for i, n in enumerate("ab")]
    engine = _engine(base, tok, adapters)
    prompt = tok.encode("Now is the winter of our discontent made glorious summer " * 2)
    cached = {}
    for i, name in enumerate(["a", "b", None, "a"]):
        engine.add_request(str(i), prompt, _params(name))
        cached[i] = _run(engine)[str(i)][-1].num_cached_tokens
    assert cached[0] == cached[1] == cached[2] == 0
    assert cached[3] > 0  # the same adapter's blocks are found again
    engine.adapters.unload("a")  # the same name loaded again: its old blocks are not reused
    engine.adapters.load("a", random_adapter(base.config, "a", seed=7))
    engine.add_request("4", prompt, _params("a"))
    assert _run(engine)["4"][-1].num_cached_tokens == 0
