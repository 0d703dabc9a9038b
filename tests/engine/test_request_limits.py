"""engine.limits: admission, one call that applies every limit; one test per limit, and the
engine's own admission goes through the same rules."""

from __future__ import annotations

import pytest
import torch
from gptserve.engine.engine import Engine, EngineConfig
from gptserve.engine.errors import RequestError
from gptserve.engine.limits import (
    MIN_TEMPERATURE,
    AdmittedRequest,
    EngineLimits,
    FieldNames,
    RequestLimits,
)
from gptserve.engine.sampler import SamplingParams
from gptserve.model import GPT, ModelConfig, get_tokenizer

ENGINE = EngineLimits(max_model_len=64, vocab_size=100, kv_block_size=16, kv_cache_blocks=3)
CHAT = FieldNames("messages", "max_completion_tokens", "top_logprobs")


def refused(limits: RequestLimits, prompts, params: SamplingParams, **kwargs) -> RequestError:  # noqa: ANN001
    with pytest.raises(RequestError) as err:
        limits.admit(prompts, params, **kwargs)
    assert "\n" not in str(err.value) and err.value.message == str(err.value)
    return err.value


def p(**fields) -> SamplingParams:  # noqa: ANN003
    return SamplingParams(**fields)


def test_context_length():
    limits = RequestLimits(EngineLimits(64, 100, 16, kv_cache_blocks=100))
    limits.admit([[1] * 60], p(max_tokens=4))
    err = refused(limits, [[1] * 60], p(max_tokens=5))
    assert (err.param, err.code) == ("max_tokens", "context_length_exceeded")
    assert "maximum context length is 64 tokens" in str(err)
    assert "60 prompt tokens plus 5" in str(err)
    err = refused(limits, [[1] * 64], p(max_tokens=1), names=CHAT)
    assert err.param == "messages"  # the prompt alone fills the context
    err = refused(limits, [[1] * 10], p(max_tokens=60), names=CHAT)
    assert err.param == "max_completion_tokens"


def test_kv_pool():
    limits = RequestLimits(ENGINE)  # 3 blocks of 16: 48 tokens, under the 64-token context
    assert ENGINE.kv_cache_tokens == 48
    limits.admit([[1] * 40], p(max_tokens=8))
    err = refused(limits, [[1] * 40], p(max_tokens=9))
    assert (err.param, err.code) == ("max_tokens", "kv_cache_exceeded")
    assert "needs 4 KV cache blocks (49 tokens) but the pool has 3 (48 tokens)" in str(err)
    assert refused(limits, [[1] * 50], p(max_tokens=1)).param == "prompt"


def test_prompt_tokens_cap():
    limits = RequestLimits(ENGINE, max_prompt_tokens=10)
    limits.admit([[1] * 10], p(max_tokens=1))
    err = refused(limits, [[1] * 11], p(max_tokens=1))
    assert (err.param, err.code) == ("prompt", "prompt_too_long")
    assert "at most 10" in str(err)


def test_max_n():
    limits = RequestLimits(ENGINE, max_n=4)
    for n in (1, 4):
        limits.admit([[1]], p(n=n))
    for n in (0, 5):
        err = refused(limits, [[1]], p(n=n))
        assert err.param == "n" and str(err) == "n must be between 1 and 4"
    RequestLimits(ENGINE).admit([[1]], p(n=1000))  # no cap: the engine takes any n


def test_max_tokens():
    capped = RequestLimits(ENGINE, max_tokens=32)
    assert capped.default_max_tokens(16) == 16
    assert capped.default_max_tokens(100) == 32  # a default is capped, not refused
    capped.admit([[1]], p(max_tokens=32))
    err = refused(capped, [[1]], p(max_tokens=33), names=CHAT)
    assert err.param == "max_completion_tokens" and "limited to 32" in str(err)
    assert refused(capped, [[1]], p(max_tokens=-1)).param == "max_tokens"
    assert RequestLimits(ENGINE).default_max_tokens(100) == 100


def test_logprobs_cap():
    limits = RequestLimits(ENGINE, max_logprobs=5)
    limits.admit([[1]], p(logprobs=5))
    err = refused(limits, [[1]], p(logprobs=6), names=CHAT)
    assert err.param == "top_logprobs" and str(err) == "top_logprobs must be between 0 and 5"
    assert refused(limits, [[1]], p(logprobs=-1)).param == "logprobs"
    assert refused(limits, [[1]], p(prompt_logprobs=6)).param == "prompt_logprobs"


def test_prompts():
    limits = RequestLimits(ENGINE, max_prompts=2)
    limits.admit([[0, 99], [1]], p())
    assert "empty" in str(refused(limits, [[]], p()))
    assert refused(limits, [], p()).param == "prompt"
    err = refused(limits, [[5, 100]], p())
    assert err.param == "prompt" and "[0, 100)" in str(err)
    err = refused(limits, [[1], [2], [3]], p(), names=CHAT)
    assert err.param == "messages" and "at most 2 prompts" in str(err)


def test_stop_strings_and_logit_bias():
    limits = RequestLimits(ENGINE, max_stop=2, max_stop_length=3, max_logit_bias=1)
    limits.admit([[1]], p(stop=["ab", "abc"], logit_bias={5: 1.0}))
    assert "at most 2 stop" in str(refused(limits, [[1]], p(stop=["a", "b", "c"])))
    assert "limited to 3 characters" in str(refused(limits, [[1]], p(stop=["abcd"])))
    assert refused(limits, [[1]], p(stop=[""])).param == "stop"
    err = refused(limits, [[1]], p(logit_bias={1: 1.0, 2: 1.0}))
    assert err.param == "logit_bias" and "at most 1" in str(err)


def test_the_sampler_ranges_and_a_constrained_output():
    limits = RequestLimits(ENGINE)
    err = refused(limits, [[1]], p(top_p=0))
    assert err.param == "top_p" and str(err) == "top_p must be in (0, 1]"
    both = p(min_tokens=2, stop_token_ids=[3])
    limits.admit([[1]], both)  # unconstrained: min_tokens bans the stop tokens for a while
    assert refused(limits, [[1]], both, constrained=True).param == "stop_token_ids"


def test_tiny_temperatures_become_greedy():
    limits = RequestLimits(ENGINE)
    for tiny in (1e-300, MIN_TEMPERATURE / 2):
        admitted = limits.admit([[1]], p(temperature=tiny))
        assert isinstance(admitted, AdmittedRequest) and admitted.params.temperature == 0.0
    for kept in (0.0, MIN_TEMPERATURE, 0.7):
        assert limits.admit([[1]], p(temperature=kept)).params.temperature == kept


@pytest.fixture(scope="module")
def engine() -> Engine:
    torch.manual_seed(0)
    model = GPT(ModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=64)).eval()
    return Engine(model, get_tokenizer(), EngineConfig(max_num_seqs=2, num_blocks=3))


def test_the_engine_admits_through_the_same_limits(engine: Engine):
    assert engine.limits == EngineLimits(64, 50257, 16, 3)
    with pytest.raises(RequestError) as err:
        engine.add_request("long", [1] * 40, SamplingParams(max_tokens=30))
    assert err.value.code == "context_length_exceeded"
    with pytest.raises(RequestError) as err:
        engine.add_request("pool", [1] * 40, SamplingParams(max_tokens=9))
    assert err.value.code == "kv_cache_exceeded"
    assert not engine.has_work()


def test_a_tiny_temperature_generates_the_greedy_tokens(engine: Engine):
    def generate(temperature: float) -> list[int]:
        params = SamplingParams(temperature=temperature, max_tokens=6, ignore_eos=True)
        engine.add_request(f"t{temperature}", [1, 2, 3], params)
        tokens = []
        while engine.has_work():
            tokens += [t for e in engine.step() for t in e.token_ids]
        return tokens

    assert generate(1e-300) == generate(0.0)
