"""engine.limits: one test per limit, and the engine's own check goes through the same rules."""

from __future__ import annotations

import pytest
import torch

from engine.engine import Engine, EngineConfig
from engine.limits import (
    MIN_TEMPERATURE,
    EngineLimits,
    RequestError,
    RequestLimits,
    snap_tiny_temperature,
)
from engine.sampler import SamplingError, SamplingParams
from model import GPT, ModelConfig, get_tokenizer

ENGINE = EngineLimits(max_model_len=64, vocab_size=100, kv_block_size=16, kv_cache_blocks=3)


def refused(check, *args, **kwargs) -> RequestError:  # noqa: ANN001
    with pytest.raises(RequestError) as err:
        check(*args, **kwargs)
    assert "\n" not in str(err.value)
    return err.value


def test_context_length():
    limits = RequestLimits(EngineLimits(64, 100, 16, kv_cache_blocks=100))
    limits.check_fits(60, 4)
    err = refused(limits.check_fits, 60, 5)
    assert (err.param, err.code) == ("max_tokens", "context_length_exceeded")
    assert "maximum context length is 64 tokens" in str(err) and "60 prompt tokens plus 5" in str(
        err
    )
    err = refused(limits.check_fits, 64, 1, "messages", "max_completion_tokens")
    assert err.param == "messages"  # the prompt alone fills the context
    err = refused(limits.check_fits, 10, 60, "messages", "max_completion_tokens")
    assert err.param == "max_completion_tokens"


def test_kv_pool():
    limits = RequestLimits(ENGINE)  # 3 blocks of 16: 48 tokens, under the 64-token context
    assert ENGINE.kv_cache_tokens == 48
    limits.check_fits(40, 8)
    err = refused(limits.check_fits, 40, 9)
    assert (err.param, err.code) == ("max_tokens", "kv_cache_exceeded")
    assert "needs 4 KV cache blocks (49 tokens) but the pool has 3 (48 tokens)" in str(err)
    assert refused(limits.check_fits, 50, 1).param == "prompt"


def test_prompt_tokens_cap():
    limits = RequestLimits(ENGINE, max_prompt_tokens=10)
    limits.check_fits(10, 1)
    err = refused(limits.check_fits, 11, 1)
    assert (err.param, err.code) == ("prompt", "prompt_too_long")
    assert "at most 10" in str(err)


def test_max_n():
    limits = RequestLimits(ENGINE, max_n=4)
    limits.check_n(1)
    limits.check_n(4)
    for n in (0, 5):
        err = refused(limits.check_n, n)
        assert err.param == "n" and str(err) == "n must be between 1 and 4"
    RequestLimits(ENGINE).check_n(1000)  # no cap: the engine takes any n the pool holds


def test_max_tokens():
    capped = RequestLimits(ENGINE, max_tokens=32)
    assert capped.max_tokens_or_default(None, 16) == 16
    assert capped.max_tokens_or_default(None, 100) == 32  # a default is capped, not refused
    assert capped.max_tokens_or_default(32, 16) == 32
    err = refused(capped.max_tokens_or_default, 33, 16, "max_completion_tokens")
    assert err.param == "max_completion_tokens" and "limited to 32" in str(err)
    assert refused(capped.check_max_tokens, -1).param == "max_tokens"
    assert RequestLimits(ENGINE).max_tokens_or_default(None, 100) == 100


def test_logprobs_cap():
    limits = RequestLimits(ENGINE, max_logprobs=5)
    limits.check_logprobs(0, "logprobs")
    limits.check_logprobs(5, "top_logprobs")
    err = refused(limits.check_logprobs, 6, "top_logprobs")
    assert err.param == "top_logprobs" and str(err) == "top_logprobs must be between 0 and 5"
    assert refused(limits.check_logprobs, -1, "logprobs").param == "logprobs"


def test_prompt_ids():
    limits = RequestLimits(ENGINE)
    limits.check_prompt_ids([0, 99])
    assert "empty" in str(refused(limits.check_prompt_ids, []))
    err = refused(limits.check_prompt_ids, [5, 100])
    assert err.param == "prompt" and "[0, 100)" in str(err)


def test_tiny_temperatures_become_greedy():
    for tiny in (1e-300, MIN_TEMPERATURE / 2):
        assert snap_tiny_temperature(SamplingParams(temperature=tiny)).temperature == 0.0
    for kept in (0.0, MIN_TEMPERATURE, 0.7):
        assert snap_tiny_temperature(SamplingParams(temperature=kept)).temperature == kept


def test_check_request_applies_every_limit_and_the_sampler_ranges():
    limits = RequestLimits(ENGINE, max_n=2, max_tokens=8, max_logprobs=3)
    params = SamplingParams(temperature=1e-9, max_tokens=8, n=2, logprobs=3)
    limits.check_request([1, 2, 3], params)
    assert params.temperature == 0.0
    for bad, param in [
        (SamplingParams(n=3), "n"),
        (SamplingParams(max_tokens=9), "max_tokens"),
        (SamplingParams(logprobs=4), "logprobs"),
        (SamplingParams(prompt_logprobs=4), "prompt_logprobs"),
    ]:
        assert refused(limits.check_request, [1], bad).param == param
    with pytest.raises(SamplingError):
        limits.check_request([1], SamplingParams(top_p=0))


@pytest.fixture(scope="module")
def engine() -> Engine:
    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=64)).eval()
    return Engine(model, get_tokenizer(), EngineConfig(max_num_seqs=2, num_blocks=3))


def test_the_engine_checks_through_the_same_limits(engine: Engine):
    assert EngineLimits.of(engine) == EngineLimits(64, 50257, 16, 3)
    err = refused(engine.check_request, [1] * 40, SamplingParams(max_tokens=30))
    assert err.code == "context_length_exceeded"
    err = refused(engine.check_request, [1] * 40, SamplingParams(max_tokens=9))
    assert err.code == "kv_cache_exceeded"
    params = SamplingParams(temperature=1e-300, max_tokens=4)
    engine.check_request([1, 2], params)
    assert params.temperature == 0.0


def test_a_tiny_temperature_generates_the_greedy_tokens(engine: Engine):
    def generate(temperature: float) -> list[int]:
        params = SamplingParams(temperature=temperature, max_tokens=6, ignore_eos=True)
        engine.add_request(f"t{temperature}", [1, 2, 3], params)
        tokens = []
        while engine.has_work():
            tokens += [t for e in engine.step() for t in e.token_ids]
        return tokens

    assert generate(1e-300) == generate(0.0)
