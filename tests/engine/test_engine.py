"""The engine: continuous batching, preemption, abort, n > 1, stop strings, prompt scoring."""

import random

import pytest
import torch
import torch.nn as nn
from gptserve.engine.engine import STEP_FAILED, Engine, EngineConfig, RequestError
from gptserve.engine.sampler import SamplingParams
from gptserve.model import GPT, ModelConfig


def run(engine: Engine, max_steps: int = 10_000) -> dict:
    """Step until idle; returns {(request, index): event list}."""
    out: dict = {}
    for _ in range(max_steps):
        if not engine.has_work():
            return out
        for ev in engine.step():
            out.setdefault((ev.request_id, ev.index), []).append(ev)
    raise AssertionError("engine did not finish")


def tokens(events) -> list[int]:
    return [t for ev in events for t in ev.token_ids]


def greedy_reference(model: GPT, prompt: list[int], n: int) -> list[int]:
    seq = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], 1)
    return seq[0, len(prompt) :].tolist()


def test_greedy_matches_plain_loop(model, tok):
    engine = Engine(model, tok, EngineConfig(kv_block_size=8, num_blocks=64))
    prompts = [tok.encode(t) for t in ["Hello there", "To be, or not to be, that is", "A"]]
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    out = run(engine)
    for i, p in enumerate(prompts):
        assert tokens(out[(str(i), 0)]) == greedy_reference(model, p, 24)
        assert out[(str(i), 0)][-1].finish_reason == "length"
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def _mixed_requests(tok):
    rng = random.Random(0)
    reqs = []
    for i in range(16):
        prompt = [rng.randrange(50257) for _ in range(rng.choice([1, 5, 17, 40, 90]))]
        params = SamplingParams(
            temperature=rng.choice([0.0, 0.7, 1.0, 1.3]),
            top_k=rng.choice([0, 5, 50]),
            top_p=rng.choice([1.0, 0.9]),
            presence_penalty=rng.choice([0.0, 0.5]),
            max_tokens=rng.choice([3, 10, 30]),
            seed=1000 + i,
            ignore_eos=True,
        )
        reqs.append((f"r{i}", prompt, params))
    return reqs


def test_requests_in_a_batch_produce_what_they_produce_alone(model, tok):
    reqs = _mixed_requests(tok)
    alone = {}
    for rid, prompt, params in reqs:
        engine = Engine(model, tok, EngineConfig(kv_block_size=8, num_blocks=128))
        engine.add_request(rid, prompt, params)
        alone[rid] = tokens(run(engine)[(rid, 0)])

    engine = Engine(model, tok, EngineConfig(kv_block_size=8, num_blocks=128, max_batch_tokens=48))
    pending = list(reqs)
    out: dict = {}
    step = 0
    while pending or engine.has_work():
        if pending and step % 2 == 0:  # arrivals spread over time, joining running sequences
            engine.add_request(*pending.pop(0))
        for ev in engine.step() if engine.has_work() else []:
            out.setdefault(ev.request_id, []).extend(ev.token_ids)
        step += 1
        assert step < 5000
    assert out == alone
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_preemption_under_a_tiny_pool_keeps_outputs_correct(model, tok):
    prompts = [tok.encode("word " * n) for n in (5, 9, 13, 20)]
    engine = Engine(model, tok, EngineConfig(kv_block_size=4, num_blocks=14, max_batch_tokens=64))
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    preempted = 0
    out: dict = {}
    for _ in range(2000):
        if not engine.has_work():
            break
        before = engine.num_waiting
        for ev in engine.step():
            out.setdefault(ev.request_id, []).extend(ev.token_ids)
        preempted += engine.num_waiting > before
    assert preempted > 0, "the pool was meant to be too small for all four at once"
    for i, p in enumerate(prompts):
        assert out[str(i)] == greedy_reference(model, p, 20)
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_abort_returns_every_block(model, tok):
    engine = Engine(model, tok, EngineConfig(kv_block_size=8, num_blocks=64))
    engine.add_request("a", tok.encode("one two three"), SamplingParams(max_tokens=100, n=3))
    engine.add_request("b", tok.encode("four"), SamplingParams(max_tokens=100))
    for _ in range(5):
        engine.step()
    assert engine.blocks.num_free_blocks < engine.blocks.num_blocks
    assert engine.abort("a") and engine.abort("b")
    assert not engine.abort("a")
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert not engine.has_work()


def test_finish_ends_one_completion_and_its_siblings_go_on(model, tok):
    """`Engine.finish` (the server's end of an answer that repeated a tool call): that one
    completion's last event, "stop" with no tokens, its blocks freed; the others run to their
    end; nothing for one not yet started, finished already, or unknown."""
    engine = Engine(model, tok, EngineConfig(kv_block_size=8, num_blocks=64))
    params = SamplingParams(max_tokens=12, n=2, seed=1, ignore_eos=True)
    engine.add_request("r", tok.encode("one two three"), params)
    assert engine.finish("r", 1) == []  # before its first token (the fork): not ended
    out: dict = {}
    for _ in range(3):
        for ev in engine.step():
            out.setdefault(ev.index, []).append(ev)
    (last,) = engine.finish("r", 0)
    assert (last.index, last.finish_reason, last.token_ids, last.text) == (0, "stop", [], "")
    assert last.num_generated == len(tokens(out[0])) == 3
    assert engine.finish("r", 0) == engine.finish("r", 2) == engine.finish("x", 0) == []
    rest = run(engine)
    assert list(rest) == [("r", 1)] and len(tokens(out[1] + rest[("r", 1)])) == 12
    assert rest[("r", 1)][-1].finish_reason == "length"
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert engine.finish("r", 1) == []  # the request is over


def test_n_completions_share_one_prefill(model, tok):
    prompt = tok.encode("The quick brown fox jumps over the lazy dog. " * 4)
    engine = Engine(model, tok, EngineConfig(kv_block_size=8, num_blocks=64))
    calls = []
    original = model.forward_cached

    def counting(tokens, *args, **kw):
        calls.append(len(tokens))
        return original(tokens, *args, **kw)

    engine.model.forward_cached = counting
    try:
        engine.add_request("r", prompt, SamplingParams(max_tokens=5, n=3, seed=3, ignore_eos=True))
        out = run(engine)
    finally:
        del engine.model.forward_cached
    assert calls[0] == len(prompt) and calls[1:] == [3] * 4  # one prefill, then 3 decodes a step
    seqs = [tokens(out[("r", i)]) for i in range(3)]
    assert all(len(s) == 5 for s in seqs) and len({tuple(s) for s in seqs}) == 3
    # the same seed gives the same three completions again
    engine.add_request("r2", prompt, SamplingParams(max_tokens=5, n=3, seed=3, ignore_eos=True))
    again = run(engine)
    assert [tokens(again[("r2", i)]) for i in range(3)] == seqs


def test_chunked_prefill_and_prompt_logprobs_match_full_forward(model, tok):
    prompt = tok.encode("Now is the winter of our discontent made glorious summer by this sun")
    engine = Engine(model, tok, EngineConfig(kv_block_size=4, num_blocks=64, max_batch_tokens=5))
    params = SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=2)
    engine.add_request("s", prompt, params)
    events = run(engine)[("s", 0)]
    assert len(events) == 1 and events[0].finish_reason == "length" and events[0].token_ids == []
    plp = events[0].prompt_logprobs
    assert plp[0] is None and len(plp) == len(prompt)
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt]))[0], -1)
    for pos in range(1, len(prompt)):
        assert plp[pos].token == prompt[pos]
        assert abs(plp[pos].logprob - ref[pos - 1, prompt[pos]].item()) < 1e-4
        assert [t for t, _ in plp[pos].top] == ref[pos - 1].topk(2).indices.tolist()


class NextTokenModel(nn.Module):
    """A mock: the next token is always a fixed function of the current one."""

    def __init__(self, script: dict[int, int], vocab: int = 50257, block_size: int = 64):
        super().__init__()
        self.config = ModelConfig(n_layer=1, n_head=1, n_embd=2, block_size=block_size)
        self.script = script
        self.vocab = vocab
        self.w = nn.Parameter(torch.zeros(1))

    def forward_cached(self, tokens, cache, meta, logits_index=None):
        index = meta.last_token_index if logits_index is None else logits_index
        logits = torch.zeros(len(index), self.vocab)
        for row, pos in enumerate(index.tolist()):
            logits[row, self.script.get(int(tokens[pos]), 0)] = 10.0
        return logits


def test_stop_string_split_across_tokens_never_leaks(tok):
    words = tok.encode(" alpha beta gamma delta")  # four tokens, chained by the mock
    script = {words[i]: words[i + 1] for i in range(len(words) - 1)}
    script[words[-1]] = words[0]
    engine = Engine(NextTokenModel(script), tok, EngineConfig(kv_block_size=4, num_blocks=32))
    params = SamplingParams(temperature=0, max_tokens=20, stop=["ta gam"])
    engine.add_request("x", [words[0]], params)
    events = run(engine)[("x", 0)]
    text = "".join(ev.text for ev in events)
    assert text == " be"  # " beta gamma" holds "ta gam" across two tokens
    assert events[-1].finish_reason == "stop"
    # text that only looked like the start of a stop string is released in the end
    engine.add_request("y", [words[0]], SamplingParams(temperature=0, max_tokens=3, stop=["ta X"]))
    assert "".join(ev.text for ev in run(engine)[("y", 0)]) == " beta gamma delta"


def test_eos_and_stop_token_ids_finish(tok):
    script = {1: 2, 2: 3, 3: tok.eot_token}
    engine = Engine(NextTokenModel(script), tok, EngineConfig(kv_block_size=4, num_blocks=32))
    engine.add_request("e", [1], SamplingParams(temperature=0, max_tokens=10))
    events = run(engine)[("e", 0)]
    assert tokens(events) == [2, 3, tok.eot_token] and events[-1].finish_reason == "stop"
    engine.add_request("s", [1], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[3]))
    assert run(engine)[("s", 0)][-1].finish_reason == "stop"
    engine.add_request("i", [1], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    events = run(engine)[("i", 0)]
    assert len(tokens(events)) == 6 and events[-1].finish_reason == "length"


def test_scheduler_respects_max_num_seqs(tok):
    engine = Engine(
        NextTokenModel({}), tok, EngineConfig(kv_block_size=4, num_blocks=64, max_num_seqs=3)
    )
    for i in range(7):
        engine.add_request(str(i), [1, 2], SamplingParams(temperature=0, max_tokens=5))
    peak = 0
    finished = 0
    while engine.has_work():
        finished += sum(ev.finished for ev in engine.step())
        peak = max(peak, engine.num_running)
    assert peak == 3 and finished == 7


def test_a_failing_step_fails_only_its_requests(model, tok):
    engine = Engine(model, tok, EngineConfig(kv_block_size=8, num_blocks=64))
    engine.add_request("bad", tok.encode("x"), SamplingParams(max_tokens=3))
    original = engine.model.forward_cached
    engine.model.forward_cached = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom"))
    try:
        events = engine.step()
    finally:
        engine.model.forward_cached = original
    assert [ev.error for ev in events] == [STEP_FAILED]  # "boom" is for the log only
    assert events[0].error_code is None
    assert engine.num_failed_steps == 1 and not engine.has_work()
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    engine.add_request("good", tok.encode("x"), SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(tokens(run(engine)[("good", 0)])) == 3


@pytest.mark.parametrize(
    "prompt,params,param",
    [
        ([], SamplingParams(), "prompt"),
        ([60000], SamplingParams(), "prompt"),
        ([1] * 250, SamplingParams(max_tokens=10), "max_tokens"),
        ([1] * 300, SamplingParams(max_tokens=1), "prompt"),
    ],
)
def test_requests_that_can_never_run_are_refused(model, tok, prompt, params, param):
    engine = Engine(model, tok, EngineConfig(kv_block_size=8, num_blocks=64))
    with pytest.raises(RequestError) as err:
        engine.add_request("r", prompt, params)
    assert err.value.param == param


def test_request_larger_than_the_pool_is_refused(model, tok):
    engine = Engine(model, tok, EngineConfig(kv_block_size=4, num_blocks=3))
    with pytest.raises(RequestError, match="KV cache blocks"):
        engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=20))
