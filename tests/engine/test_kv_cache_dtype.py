"""A KV cache of its own dtype (`EngineConfig.kv_cache_dtype`, the server's --kv-cache-dtype):
float16 or bfloat16 keys and values under a float32 model hold twice the tokens in the same
bytes and change the outputs only by the cache's rounding, on every CPU path: GPT-2 as trained
and swapped for CPU inference (the one-call layer and `paged_decode_qkv`), a Llama-shaped model
(rotary positions, grouped-query attention), and prefills that take the PyTorch paths."""

from __future__ import annotations

import copy

import pytest
import torch
from gptserve.engine.engine import Engine, EngineConfig
from gptserve.engine.sampler import SamplingParams
from gptserve.kernels.paged_kv import cache_dtype
from gptserve.model import GPT, ModelConfig, get_tokenizer
from gptserve.model.cpu import optimize_for_cpu

LLAMA = dict(
    n_layer=2, n_head=6, n_kv_head=2, n_embd=96, pos_encoding="rotary", norm="rmsnorm",
    activation="swiglu", bias=False, block_size=256,
)  # fmt: skip
GPT2 = dict(n_layer=2, n_head=4, n_embd=64, block_size=256)


def models() -> dict[str, GPT]:
    torch.manual_seed(0)
    gpt2 = GPT(ModelConfig(**GPT2)).eval()
    torch.manual_seed(0)
    llama = GPT(ModelConfig(**LLAMA)).eval()
    return {
        "gpt2": gpt2,
        "gpt2 for the CPU": optimize_for_cpu(copy.deepcopy(gpt2)),
        "llama for the CPU": optimize_for_cpu(llama),
    }


MODELS = models()


def generate(model: GPT, kv_dtype: torch.dtype | None) -> tuple[Engine, dict[str, list]]:
    """Three prompts of different lengths, greedy, each token's logprob: {request: [(token,
    logprob)]}; the engine's cache holds 64 KiB of keys and values."""
    config = EngineConfig(max_num_seqs=3, kv_cache_bytes=64 << 10, kv_cache_dtype=kv_dtype)
    engine = Engine(model, get_tokenizer(), config)
    gen = torch.Generator().manual_seed(1)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
    for i, n in enumerate((5, 23, 40)):
        engine.add_request(str(i), torch.randint(0, 50000, (n,), generator=gen).tolist(), params)
    out: dict[str, list] = {}
    for _ in range(200):
        if not engine.has_work():
            return engine, out
        for ev in engine.step():
            out.setdefault(ev.request_id, []).extend(
                (t, lp.logprob) for t, lp in zip(ev.token_ids, ev.logprobs)
            )
    raise AssertionError("the engine did not finish")


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(MODELS))
def test_a_narrower_cache_holds_twice_the_tokens_and_moves_outputs_by_its_rounding(
    name: str, kv_dtype: torch.dtype
) -> None:
    model = MODELS[name]
    wide, want = generate(model, None)
    narrow, got = generate(model, kv_dtype)
    assert wide.pools.k.dtype == torch.float32 and narrow.pools.k.dtype == kv_dtype
    assert narrow.blocks.num_blocks == 2 * wide.blocks.num_blocks
    assert narrow.pools.bytes_per_token * 2 == wide.pools.bytes_per_token
    tolerance = 2e-3 if kv_dtype == torch.float16 else 2e-2
    for request, tokens in want.items():
        assert len(got[request]) == len(tokens) == 12
        agree = 0
        for (t_want, lp_want), (t_got, lp_got) in zip(tokens, got[request]):
            if t_want != t_got:  # a near tie may flip; everything after it differs
                break
            assert abs(lp_got - lp_want) < tolerance
            agree += 1
        assert agree >= 4, (request, tokens, got[request])


def test_the_model_dtype_is_the_default_and_a_same_dtype_cache_changes_nothing() -> None:
    model = MODELS["gpt2 for the CPU"]
    _, default = generate(model, None)
    same, explicit = generate(model, torch.float32)
    assert same.pools.k.dtype == torch.float32
    assert explicit == default


@pytest.mark.parametrize("kv_dtype", [torch.float16, torch.bfloat16], ids=str)
def test_a_sequence_gets_the_same_logprobs_whether_or_not_a_prefill_shares_its_steps(
    kv_dtype: torch.dtype,
) -> None:
    # decode-only steps take the one-call kernel; a step that also prefills takes
    # `CpuPagedBackend.forward`: both keep the query in float32 over the narrower cache
    model = MODELS["llama for the CPU"]
    gen = torch.Generator().manual_seed(2)
    mine = torch.randint(0, 50000, (9,), generator=gen).tolist()
    other = torch.randint(0, 50000, (30,), generator=gen).tolist()
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=0)
    runs = []
    for joined in (False, True):
        config = EngineConfig(max_num_seqs=2, max_batch_tokens=8, kv_cache_dtype=kv_dtype,
                              batch_invariant=True)  # fmt: skip
        engine = Engine(model, get_tokenizer(), config)
        engine.add_request("mine", mine, params)
        got: list = []
        for step in range(200):
            if step == 3 and joined:  # its prompt is prefilled 8 tokens a step beside mine
                engine.add_request("other", other, params)
            if not engine.has_work():
                break
            for ev in engine.step():
                if ev.request_id == "mine":
                    got.extend((t, lp.logprob) for t, lp in zip(ev.token_ids, ev.logprobs))
        runs.append(got)
    assert len(runs[0]) == 10 and runs[0] == runs[1]


def test_a_cache_is_the_models_dtype_or_narrower_than_float32() -> None:
    assert cache_dtype(torch.float32, None) == torch.float32
    assert cache_dtype(torch.bfloat16, torch.bfloat16) == torch.bfloat16
    assert cache_dtype(torch.float32, torch.float16) == torch.float16
    for model_dtype, asked in [(torch.bfloat16, torch.float32), (torch.bfloat16, torch.float16),
                               (torch.float16, torch.float32)]:  # fmt: skip
        with pytest.raises(ValueError, match="does not go with a"):
            cache_dtype(model_dtype, asked)
    with pytest.raises(ValueError, match="--kv-cache-dtype float32 does not go with a bfloat16"):
        Engine(GPT(ModelConfig(**GPT2)).to(torch.bfloat16), get_tokenizer(),
               EngineConfig(kv_cache_dtype=torch.float32))  # fmt: skip
