"""Cache salts: sequences with different salts never share a KV block, nor learn anything from
each other's prompts through the prefix cache; sequences with the same salt still do."""

from __future__ import annotations

import random

import pytest
import torch
from gptserve.engine.block_manager import BlockManager
from gptserve.engine.engine import Engine, EngineConfig
from gptserve.engine.errors import RequestError
from gptserve.engine.sampler import SamplingParams
from gptserve.model import GPT, ModelConfig, get_tokenizer

BLOCK = 4


def _cache(num_blocks: int = 32) -> BlockManager:
    return BlockManager(num_blocks, BLOCK)


def _prefill(cache: BlockManager, seq_id: int, tokens: list[int], salt: str | None) -> int:
    """Admit a sequence the way the scheduler does, compute the rest, key its blocks; returns
    the tokens it found cached."""
    hit = cache.reuse_prefix(seq_id, tokens, salt)
    cache.prepare([(seq_id, len(tokens) - hit)])
    cache.register_full_blocks(seq_id, tokens, salt)
    return hit


def test_a_salted_prompt_matches_only_blocks_of_its_own_salt() -> None:
    cache = _cache()
    prompt = list(range(100, 111))  # two full blocks and 3 tokens of a third
    assert _prefill(cache, 0, prompt, "tenant-a") == 0
    cache.free(0)  # its partly filled block is keyed too, under the same salt
    assert _prefill(cache, 1, prompt, "tenant-b") == 0
    assert _prefill(cache, 2, prompt, None) == 0
    assert _prefill(cache, 3, prompt, "tenant-a") == len(prompt) - 1
    # a prompt shorter than a block: only the (copied) partial match, and only under its salt
    cache.free(3)
    short = prompt[:3]
    assert _prefill(cache, 4, short + [1], "tenant-a") == 3
    assert _prefill(cache, 5, short + [1], "tenant-c") == 0
    cache.audit()


def test_an_unsalted_prompt_does_not_match_salted_blocks_and_the_reverse() -> None:
    cache = _cache()
    prompt = list(range(9))
    _prefill(cache, 0, prompt, None)
    cache.free(0)
    assert _prefill(cache, 1, prompt, "s") == 0
    assert _prefill(cache, 2, prompt, None) == len(prompt) - 1
    cache.free(1)
    cache.free(2)
    assert _prefill(cache, 3, prompt, "s") == len(prompt) - 1


def test_salts_that_differ_only_in_how_they_are_written_are_distinct() -> None:
    cache = _cache()
    prompt = list(range(9))
    _prefill(cache, 0, prompt, "a")
    for seq_id, salt in enumerate(["A", "a ", " a", "ab"], start=1):
        assert _prefill(cache, seq_id, prompt, salt) == 0, salt


def test_the_engine_rejects_an_empty_salt() -> None:
    with pytest.raises(RequestError, match="cache_salt"):
        SamplingParams(cache_salt="").validate()


# ---- through the engine ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model() -> GPT:
    torch.manual_seed(0)
    return GPT(ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=128)).eval()


def _engine(model: GPT, caching: bool = True) -> Engine:
    config = EngineConfig(kv_block_size=BLOCK, prefix_caching=caching, max_num_seqs=6)
    return Engine(model, get_tokenizer(), config)


def _disjoint_across_salts(engine: Engine) -> None:
    """No block is held by two live sequences of different salts."""
    owner: dict[int, str | None] = {}
    for seq in engine.scheduler.running:
        salt = seq.params.cache_salt
        for block in engine.blocks.block_table(seq.seq_id):
            assert owner.setdefault(block, salt) == salt, f"block {block} shared across salts"


def _run(engine: Engine, requests: list[tuple[str, list[int], SamplingParams]]) -> dict:
    """Add the requests a few at a time while earlier ones run; check the pool after each step.
    Returns request -> (its tokens, its cached prompt tokens)."""
    out: dict[str, tuple[list[int], int]] = {}
    pending = list(requests)
    for _ in range(5000):
        if not pending and not engine.has_work():
            break
        for rid, prompt, params in pending[:2]:
            engine.add_request(rid, prompt, params)
        pending = pending[2:]
        for ev in engine.step():
            assert ev.error is None, ev.error
            tokens, _ = out.get(ev.request_id, ([], 0))
            if ev.index == 0:
                out[ev.request_id] = (tokens + ev.token_ids, ev.num_cached_tokens)
        engine.blocks.audit()
        _disjoint_across_salts(engine)
    assert not engine.has_work()
    return out


def _workload(seed: int) -> list[tuple[str, list[int], SamplingParams]]:
    """Prompts that share long prefixes, each with one of a few salts (or none)."""
    rng = random.Random(seed)
    stems = [[rng.randrange(50, 500) for _ in range(rng.randrange(3, 14))] for _ in range(3)]
    requests = []
    for i in range(24):
        prompt = list(rng.choice(stems)) + [rng.randrange(50, 500) for _ in range(rng.randrange(4))]
        salt = rng.choice([None, "a", "b", "c"])
        params = SamplingParams(
            temperature=0, max_tokens=rng.randrange(1, 6), n=rng.choice([1, 1, 2]),
            ignore_eos=True, cache_salt=salt,
            prompt_logprobs=rng.choice([None, None, None, 1]),
        )  # fmt: skip
        requests.append((f"r{i}", prompt, params))
    return requests


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_salted_requests_never_share_blocks_and_hit_only_their_own_salts_prompts(
    model: GPT, seed: int
) -> None:
    requests = _workload(seed)
    salted = _run(_engine(model), requests)
    plain = _run(_engine(model, caching=False), requests)
    seen: dict[str | None, list[list[int]]] = {}
    hits = 0
    for rid, prompt, params in requests:
        tokens, cached = salted[rid]
        assert tokens == plain[rid][0], rid  # the cache never changes the output
        earlier = seen.setdefault(params.cache_salt, [])
        # what it found cached is at most the longest prefix it shares with an earlier prompt
        # of its own salt (requests earlier in the list were added no later than it)
        shared = max((_common(prompt, p) for p in earlier), default=0)
        assert cached <= shared, (rid, params.cache_salt, cached, shared)
        hits += cached > 0
        earlier.append(prompt)
    assert hits > 0  # the same salt still reuses: the test is not vacuous


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def test_a_scored_prompt_and_the_forks_of_n_keep_their_salt(model: GPT) -> None:
    """A prompt_logprobs request (which reuses nothing but is still cached) and the n > 1
    completions that share a prompt key their blocks under the request's salt."""
    prompt = list(range(60, 75))
    first = [
        ("scored", prompt, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1,
                                          cache_salt="a")),
        ("forked", prompt[:9], SamplingParams(temperature=0, max_tokens=6, n=2, cache_salt="a")),
    ]  # fmt: skip
    probes = [
        ("other", prompt, SamplingParams(temperature=0, max_tokens=1, cache_salt="b")),
        ("none", prompt, SamplingParams(temperature=0, max_tokens=1)),
        ("same", prompt, SamplingParams(temperature=0, max_tokens=1, cache_salt="a")),
    ]
    engine = _engine(model)
    _run(engine, first)
    out = _run(engine, probes)
    assert out["other"][1] == 0 and out["none"][1] == 0
    assert out["same"][1] == len(prompt) - 1
