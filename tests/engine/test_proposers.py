"""Speculative decoding through the engine: the same greedy output, fewer steps, batching kept."""

import pytest
import torch
from gptserve.engine.block_manager import OutOfBlocks
from gptserve.engine.engine import Engine, EngineConfig
from gptserve.engine.proposers import DraftProposer, Speculator
from gptserve.engine.sampler import SamplingParams
from gptserve.engine.sequence import Sequence
from gptserve.model import GPT, ModelConfig, get_tokenizer


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return GPT(ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=192)).eval()


@pytest.fixture(scope="module")
def tok():
    return get_tokenizer()


def run(engine: Engine, requests: dict) -> tuple[dict, int]:
    """Add the requests, step until idle (auditing the cache); returns (tokens by key, steps)."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    out: dict = {}
    steps = 0
    while engine.has_work():
        steps += 1
        assert steps < 2000
        for ev in engine.step():
            assert ev.error is None
            got = out.setdefault((ev.request_id, ev.index), {"tokens": [], "finish": None})
            got["tokens"] += ev.token_ids
            got["finish"] = ev.finish_reason or got["finish"]
        engine.blocks.audit()
    return out, steps


def repeating_prompts(n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, 50000, (12,), generator=gen).tolist() * 3 for _ in range(n)]


GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.mark.parametrize("kind", ["ngram", "draft"])
def test_greedy_output_is_the_same_and_takes_fewer_steps(model, tok, kind):
    requests = {str(i): (p, GREEDY) for i, p in enumerate(repeating_prompts(3))}
    plain, plain_steps = run(Engine(model, tok, EngineConfig(kv_block_size=8)), requests)
    config = EngineConfig(kv_block_size=8, speculative=kind, num_speculative_tokens=4)
    engine = Engine(model, tok, config, draft_model=model if kind == "draft" else None)
    spec, spec_steps = run(engine, requests)
    assert spec == plain
    assert all(len(v["tokens"]) == 40 and v["finish"] == "length" for v in spec.values())
    assert engine.speculator.accepted_tokens > 0 and spec_steps < plain_steps
    if kind == "draft":  # the target as its own draft: every guess is right
        assert engine.speculator.accepted_tokens == engine.speculator.proposed_tokens
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_stops_max_tokens_and_batches_beyond_the_limit_fall_back(model, tok):
    prompts = repeating_prompts(6)
    requests = {
        "short": (prompts[0], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)),
        "logprobs": (
            prompts[1],
            SamplingParams(temperature=0, max_tokens=20, logprobs=2, ignore_eos=True),
        ),  # fmt: skip
        **{f"x{i}": (p, GREEDY) for i, p in enumerate(prompts[2:])},
    }
    plain, _ = run(Engine(model, tok, EngineConfig(kv_block_size=8)), requests)
    config = EngineConfig(kv_block_size=8, speculative="ngram", speculative_max_batch=3)
    engine = Engine(model, tok, config)
    spec, _ = run(engine, requests)  # 6 sequences decode at first: no guesses until 3 remain
    assert spec == plain
    assert len(spec[("short", 0)]["tokens"]) == 3


def test_sampled_requests_go_through_rejection_sampling(model, tok):
    # top_k=1 makes the target distribution a point mass on the argmax: the sampled path must then
    # give the greedy output, for each of n completions
    params = SamplingParams(temperature=0.7, top_k=1, seed=3, max_tokens=30, ignore_eos=True, n=2)
    prompt = repeating_prompts(1)[0]
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    plain, _ = run(Engine(model, tok, EngineConfig(kv_block_size=8)), {"g": (prompt, greedy)})
    engine = Engine(model, tok, EngineConfig(kv_block_size=8, speculative="ngram"))
    out, _ = run(engine, {"s": (prompt, params)})
    assert out[("s", 0)]["tokens"] == out[("s", 1)]["tokens"] == plain[("g", 0)]["tokens"]
    assert engine.speculator.accepted_tokens > 0


def test_bad_configurations_are_refused(model, tok):
    with pytest.raises(ValueError, match="needs a draft model"):
        Engine(model, tok, EngineConfig(speculative="draft"))
    with pytest.raises(ValueError, match='"ngram" or "draft"'):
        Engine(model, tok, EngineConfig(speculative="medusa"))


def test_a_lone_prompt_longer_than_a_step_is_prefilled_in_chunks(model, tok):
    engine = Engine(model, tok, EngineConfig(kv_block_size=8, max_batch_tokens=16))
    out, _ = run(engine, {"long": (repeating_prompts(1)[0], GREEDY)})  # 36 tokens, 16 a step
    assert len(out[("long", 0)]["tokens"]) == 40


def test_draft_speculation_survives_preemption_and_matches_plain(model, tok):
    requests = {str(i): (p, GREEDY) for i, p in enumerate(repeating_prompts(3))}
    plain, _ = run(Engine(model, tok, EngineConfig(kv_block_size=4, num_blocks=40)), requests)
    config = EngineConfig(kv_block_size=4, num_blocks=40, speculative="draft")
    engine = Engine(model, tok, config, draft_model=model)
    spec, _ = run(engine, requests)  # 3 x 76 tokens in 160 slots: sequences are preempted
    assert spec == plain


def test_n_completions_fork_when_the_prompt_ends_in_a_one_token_chunk(model, tok):
    # a request already decoding, then one whose prompt's last chunk is a single token
    prompts = repeating_prompts(2)
    config = dict(kv_block_size=8, max_batch_tokens=16)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=2)
    requests = {"a": (prompts[0], GREEDY), "b": (prompts[1][:16], params)}
    plain, _ = run(Engine(model, tok, EngineConfig(**config)), requests)
    spec, _ = run(Engine(model, tok, EngineConfig(**config, speculative="ngram")), requests)
    assert spec == plain and len(spec[("b", 1)]["tokens"]) == 12


class _FixedGuesses:
    """A proposer that always offers the same guesses (the test decides what verification says)."""

    def __init__(self) -> None:
        self.calls = 0

    def propose(self, seqs):
        self.calls += 1
        return {s.seq_id: [1, 2, 3, 4][:k] for s, k in seqs}

    def forget(self, seq_id: int) -> None:
        pass


def _decoding_sequence(tok) -> Sequence:
    params = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
    seq = Sequence(0, "r", 0, [5, 6, 7], params, tok)
    seq.token_ids.append(8)  # one generated token, not yet in the cache: decoding
    seq.num_cached = len(seq.token_ids) - 1
    return seq


@pytest.mark.parametrize("accepted", [0, 4])
def test_guesses_that_keep_failing_are_tried_ever_more_rarely(tok, accepted):
    proposer = _FixedGuesses()
    speculator = Speculator(proposer, num_tokens=4, max_batch=4)
    seq = _decoding_sequence(tok)
    tried = 0
    for _ in range(1000):
        guesses = speculator.propose([seq], max_len=100_000).get(seq.seq_id, [])
        if guesses:
            tried += 1
            speculator.record(seq, len(guesses), accepted)
    if accepted:  # every guess right: guesses every step
        assert tried == 1000
    else:  # 2 tries, then pauses of 16, 32, ..., 512 steps: 6 runs of 2 tries in 1000 steps
        assert tried == 12
        assert speculator.proposed_tokens == 4 * tried and speculator.accepted_tokens == 0


def _cached_keys(proposer: DraftProposer, seq_id: int, n: int) -> torch.Tensor:
    """The keys of a sequence's first n tokens in the draft's cache, (n_layer, n, n_head, hd)."""
    k = proposer.pools.k[:, proposer.blocks.block_table(seq_id)]  # (L, blocks, block, H, hd)
    return k.reshape(k.shape[0], -1, *k.shape[3:])[:, :n]


@pytest.mark.parametrize("fault", ["out_of_blocks", "forward_error"])
def test_a_failed_draft_step_leaves_the_draft_in_step_with_its_sequence(tok, monkeypatch, fault):
    torch.manual_seed(1)
    draft = GPT(ModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=64)).eval()
    proposer = DraftProposer(draft, max_num_seqs=1, block_size=4)
    seq = _decoding_sequence(tok)
    if fault == "out_of_blocks":  # the draft's pool is full
        owner, name, error = proposer.blocks, "prepare", OutOfBlocks("full")
    else:  # the draft's forward fails after its cache room was reserved
        owner, name, error = draft, "forward_cached", RuntimeError("boom")
    original = getattr(owner, name)
    faults = [error]

    def fails_once(*args, **kwargs):
        if faults:
            raise faults.pop()
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, fails_once)
    if fault == "out_of_blocks":
        assert proposer.propose([(seq, 3)]) == {}  # a full pool: no guesses this step
    else:
        with pytest.raises(RuntimeError, match="boom"):
            proposer.propose([(seq, 3)])
    seq.token_ids.append(9)  # the step decoded plainly
    seq.num_cached += 1

    got = proposer.propose([(seq, 3)])
    fresh = DraftProposer(draft, max_num_seqs=1, block_size=4)
    want = fresh.propose([(seq, 3)])
    assert got == want and len(want[seq.seq_id]) == 3
    length = fresh.blocks.seq_len(seq.seq_id)
    assert proposer.blocks.seq_len(seq.seq_id) == length == len(seq.token_ids) + 2
    assert torch.equal(
        _cached_keys(proposer, seq.seq_id, length), _cached_keys(fresh, seq.seq_id, length)
    )
