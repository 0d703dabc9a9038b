"""Prefix caching through the engine: the same greedy tokens and logprobs with and without it.

Every run is audited after every step: reference counts match the block tables, no block is free
twice, and nothing is written into a block while it is shared (the audit checks the tables; the
cache copies a shared block before a write, tested in tests/model/test_block_pool.py).
"""

import pytest
import torch
from gptserve.engine.engine import Engine, EngineConfig
from gptserve.engine.sampler import SamplingParams
from gptserve.model import GPT, ModelConfig, get_tokenizer

BLOCK = 4


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return GPT(ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=128)).eval()


def _run(engine: Engine, requests: dict, waves: list[list[str]]) -> dict:
    """Submit the waves one after another (each after the previous finished); audit each step."""
    out: dict = {}
    for wave in waves:
        for rid in wave:
            prompt, params = requests[rid]
            engine.add_request(rid, prompt, params)
        for _ in range(2000):
            if not engine.has_work():
                break
            for ev in engine.step():
                assert ev.error is None, ev.error
                got = out.setdefault((ev.request_id, ev.index), {"tokens": [], "lp": []})
                got["tokens"] += ev.token_ids
                got["lp"] += [lp.logprob for lp in ev.logprobs]
                got["cached"] = ev.num_cached_tokens
            engine.blocks.audit()
        assert not engine.has_work()
    return out


def _both(model, requests, waves, **config):
    runs = []
    for caching in (False, True):
        engine = Engine(
            model,
            get_tokenizer(),
            EngineConfig(kv_block_size=BLOCK, prefix_caching=caching, **config),
        )
        runs.append((_run(engine, requests, waves), engine))
    return runs


def _same(off: dict, on: dict) -> None:
    assert off.keys() == on.keys()
    for key in off:
        assert on[key]["tokens"] == off[key]["tokens"], key
        torch.testing.assert_close(on[key]["lp"], off[key]["lp"], atol=1e-4, rtol=0)


def _prompts(seed: int = 0) -> tuple[list[int], dict]:
    gen = torch.Generator().manual_seed(seed)
    system = torch.randint(0, 50000, (4 * BLOCK + 2,), generator=gen).tolist()  # 4 full blocks + 2
    tail = lambda n: torch.randint(0, 50000, (n,), generator=gen).tolist()  # noqa: E731
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    requests = {
        "base": (system + tail(5), params),
        "none": (tail(23), params),  # shares no block
        "one": (system[:BLOCK] + tail(9), params),  # shares one full block
        "several": (system[: 3 * BLOCK] + tail(3), params),  # shares three
        "all": (list(system + tail(5)), params),  # the base prompt again: all its full blocks
    }
    requests["all"] = (list(requests["base"][0]), params)
    return system, requests


def test_greedy_tokens_and_logprobs_match_for_0_1_several_and_all_shared_blocks(model):
    _, requests = _prompts()
    waves = [["base"], ["none", "one", "several", "all"]]
    (off, _), (on, engine) = _both(model, requests, waves)
    _same(off, on)
    cached = {rid: on[(rid, 0)]["cached"] for rid in requests}
    # "all": its 5 full blocks, then 2 of the 3 tokens after them (one is left to compute) from
    # a copy of the base's sixth block, which holds those 3 tokens and a generated one
    assert cached == {"base": 0, "none": 0, "one": BLOCK, "several": 3 * BLOCK, "all": 22}
    assert all(off[(rid, 0)]["cached"] == 0 for rid in requests)
    assert engine.blocks.prefix_hit_tokens == 9 * BLOCK + 2
    assert engine.kv_usage == 0  # cached-but-free blocks are not in use


def test_n_completions_share_the_prompt_and_match(model):
    _, requests = _prompts(1)
    prompt = requests["base"][0]
    params = SamplingParams(
        temperature=0.8, seed=5, max_tokens=10, ignore_eos=True, n=3, logprobs=1
    )
    requests = {"fork": (prompt, params), "again": (prompt, params)}
    (off, _), (on, engine) = _both(model, requests, [["fork"], ["again"]])
    _same(off, on)
    assert [on[("again", i)]["cached"] for i in range(3)] == [5 * BLOCK + 2] * 3


def test_a_next_turn_reuses_the_last_turn_to_the_token_and_matches(model):
    _, requests = _prompts(5)
    prompt, params = requests["base"]
    engine = Engine(model, get_tokenizer(), EngineConfig(kv_block_size=BLOCK))
    answer = _run(engine, {"base": (prompt, params)}, [["base"]])[("base", 0)]["tokens"]
    # the next turn resends the conversation: prompt, answer (all but its last token was
    # computed), then new tokens; it ends inside a block, so whole blocks alone stop short
    history = prompt + answer
    follow = {"base": (prompt, params), "next": (history + [7, 8, 9], params)}
    (off, _), (on, engine) = _both(model, follow, [["base"], ["next"]])
    _same(off, on)
    computed = len(prompt) + len(answer) - 1  # the KV the first turn left behind
    assert computed % BLOCK != 0
    assert on[("next", 0)]["cached"] == computed > computed // BLOCK * BLOCK


def test_preemption_and_eviction_mid_run_keep_outputs_identical(model):
    _, requests = _prompts(2)
    extra = torch.randint(0, 50000, (6, 30), generator=torch.Generator().manual_seed(3)).tolist()
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
    for i, p in enumerate(extra):
        requests[f"x{i}"] = (requests["base"][0][: 2 * BLOCK] + p, params)
    # a pool too small for everything at once: sequences are preempted and cached blocks evicted
    waves = [["base"], list(requests)]
    (off, _), (on, engine) = _both(model, requests, waves, num_blocks=40, max_num_seqs=8)
    _same(off, on)
    assert engine.blocks.prefix_hit_tokens > 0


def test_prompt_logprobs_requests_reuse_nothing_and_still_score_every_token(model):
    _, requests = _prompts(4)
    scoring = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    requests["score"] = (requests["base"][0], scoring)
    engine = Engine(model, get_tokenizer(), EngineConfig(kv_block_size=BLOCK))
    engine.add_request("base", *requests["base"])
    while engine.has_work():
        engine.step()
    engine.add_request("score", *requests["score"])
    events = []
    while engine.has_work():
        events += engine.step()
    scored = next(ev.prompt_logprobs for ev in events if ev.prompt_logprobs)
    assert len(scored) == len(requests["base"][0]) and scored[0] is None
    assert all(lp is not None for lp in scored[1:])
    assert events[-1].num_cached_tokens == 0
