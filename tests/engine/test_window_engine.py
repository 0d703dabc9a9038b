"""Sliding-window models through the engine: tokens and logprobs equal the full forward's (which
applies each layer's window with its own mask), and a model whose every layer is windowed holds
only the blocks its windows can still read, with prefix caching, speculative decoding and
preemption as they are for any model."""

from __future__ import annotations

import pytest
import torch
from gptserve.engine.block_manager import RELEASED, BlockManager
from gptserve.engine.engine import Engine, EngineConfig
from gptserve.engine.sampler import SamplingParams
from gptserve.model import GPT, ModelConfig

BS = 4  # tokens per KV block: a window of 8 spans blocks


def _model(window: int | None = 8, layer_types: list[str] | None = None, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    config = ModelConfig(
        vocab_size=50257, block_size=256, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
        pos_encoding="rotary", norm="rmsnorm", activation="swiglu", bias=False,
        sliding_window=window, layer_types=layer_types,
    )  # fmt: skip
    return GPT(config).eval()


def _prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 50257, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _reference(model: GPT, prompt: list[int], n_new: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs from the full (uncached) forward."""
    ids, lps = list(prompt), []
    with torch.no_grad():
        for _ in range(n_new):
            logp = torch.log_softmax(model(torch.tensor([ids]))[0, -1].float(), -1)
            token = int(logp.argmax())
            ids.append(token)
            lps.append(float(logp[token]))
    return ids[len(prompt) :], lps


def _run(engine: Engine, prompts: dict[str, list[int]], n_new: int, watch=None):
    """Greedy completions of every prompt, added at once; `watch(engine)` after each step."""
    params = SamplingParams(temperature=0, max_tokens=n_new, ignore_eos=True, logprobs=0)
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params)
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    lps: dict[str, list[float]] = {rid: [] for rid in prompts}
    while engine.has_work():
        for ev in engine.step():
            assert ev.error is None, ev.error
            tokens[ev.request_id] += ev.token_ids
            lps[ev.request_id] += [lp.logprob for lp in ev.logprobs]
        engine.blocks.audit()
        if watch is not None:
            watch(engine)
    return tokens, lps


def _held(engine: Engine) -> int:
    return engine.blocks.num_blocks - engine.blocks.num_free_blocks


def _assert_matches(model, prompts, tokens, lps, n_new):
    for rid, prompt in prompts.items():
        want_tokens, want_lps = _reference(model, prompt, n_new)
        assert tokens[rid] == want_tokens
        assert lps[rid] == pytest.approx(want_lps, abs=1e-4)


@pytest.mark.parametrize("native", ["1", "0"], ids=["compiled", "pytorch"])
def test_windowed_generation_past_the_window_holds_only_the_window(monkeypatch, tok, native):
    """Prompt 20, 60 new tokens, window 8: the full forward's tokens and logprobs, and after the
    prefill never more blocks than the window reaches (plus the one being written)."""
    monkeypatch.setenv("GPTSERVE_NATIVE", native)
    from gptserve.kernels.cpu.native import native_ops

    native_ops.cache_clear()
    model = _model(window=8)
    engine = Engine(model, tok, EngineConfig(kv_block_size=BS, num_blocks=64))
    peak = []
    tokens, lps = _run(engine, {"a": _prompt(20)}, 60, lambda e: peak.append(_held(e)))
    native_ops.cache_clear()
    _assert_matches(model, {"a": _prompt(20)}, tokens, lps, 60)
    assert max(peak[2:-1]) <= 8 // BS + 2  # decode steps: the window's blocks and the next one
    # the same model without windows: different logprobs past the window
    plain = _model(window=None)
    assert _reference(plain, _prompt(20), 60)[1] != pytest.approx(lps["a"], abs=1e-4)


def test_a_global_layer_keeps_every_block(tok):
    model = _model(window=8, layer_types=["sliding_attention", "full_attention"])
    engine = Engine(model, tok, EngineConfig(kv_block_size=BS, num_blocks=64))
    peak = []
    tokens, lps = _run(engine, {"a": _prompt(20)}, 40, lambda e: peak.append(_held(e)))
    _assert_matches(model, {"a": _prompt(20)}, tokens, lps, 40)
    assert max(peak) == -(-(20 + 40 - 1) // BS)  # every token's block, to the end


def test_batched_sequences_and_preemption(tok):
    """Several sequences in a pool too small for all at once: preempted ones recompute, and
    every completion is still the full forward's."""
    model = _model(window=16)  # up to 6 blocks a sequence, 4 sequences, 14 blocks
    engine = Engine(model, tok, EngineConfig(kv_block_size=BS, num_blocks=14, max_num_seqs=4))
    prompts = {str(i): _prompt(5 + 2 * i, seed=i) for i in range(4)}
    tokens, lps = _run(engine, prompts, 24)
    _assert_matches(model, prompts, tokens, lps, 24)
    assert engine.num_preemptions > 0


def test_prefix_caching_reuses_only_valid_blocks(tok):
    """A windowed sequence releases its early prompt blocks while it decodes; they stay cached by
    their contents, and a later request with the same prompt reuses them. Other requests in
    between take blocks from the pool (evicting some). Every completion is the full forward's."""
    model = _model(window=8)
    engine = Engine(model, tok, EngineConfig(kv_block_size=BS, num_blocks=24))
    shared = _prompt(24, seed=7)
    runs = [{"first": shared}, {"other": _prompt(30, seed=8)}, {"again": shared + [11, 12]}]
    for prompts in runs:
        tokens, lps = _run(engine, prompts, 20)
        _assert_matches(model, prompts, tokens, lps, 20)
    assert engine.blocks.prefix_hit_tokens > 0


def test_speculative_decoding_with_windows(tok):
    """Prompt-lookup guesses on text that repeats: verification chunks, rejected guesses
    truncated, blocks released only behind the settled tokens."""
    model = _model(window=8)
    engine = Engine(model, tok, EngineConfig(kv_block_size=BS, num_blocks=64, speculative="ngram"))
    prompt = _prompt(6, seed=3) * 4
    tokens, lps = _run(engine, {"s": prompt}, 40)
    _assert_matches(model, {"s": prompt}, tokens, lps, 40)


def test_n_completions_share_then_release(tok):
    model = _model(window=8)
    engine = Engine(model, tok, EngineConfig(kv_block_size=BS, num_blocks=64))
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, n=3)
    engine.add_request("n", _prompt(22), params)
    out: dict[int, list[int]] = {}
    while engine.has_work():
        for ev in engine.step():
            out.setdefault(ev.index, []).extend(ev.token_ids)
        engine.blocks.audit()
    want, _ = _reference(model, _prompt(22), 30)
    assert all(toks == want for toks in out.values()) and len(out) == 3


def test_released_blocks_are_never_keyed_nor_claimed():
    """A block released before its sequence keyed it goes back to the pool unkeyed: another
    sequence may overwrite it, and no prompt can match it later."""
    bm = BlockManager(8, BS, window=6)
    tokens = list(range(100, 113))
    bm.prepare([(0, 12)])  # 12 tokens in 3 blocks, not keyed yet
    bm.prepare([(0, 1)])  # the next token sees 7 .. 12: block 0 (0 .. 3) is out of the window
    assert bm.num_released(0) == 1 and bm.block_table(0)[0] == RELEASED
    bm.register_full_blocks(0, tokens)
    bm.prepare([(1, 4)])  # another sequence takes the released block
    bm.audit()
    assert bm.reuse_prefix(2, tokens) == 0  # the chain starts at a block nobody holds for it
    bm.free(0)
    bm.audit()
    assert bm.num_free_blocks == 8 - 1  # only sequence 1's block is held


def test_release_keeps_the_block_being_written():
    bm = BlockManager(16, BS, window=1)
    bm.prepare([(0, 8)])  # two full blocks
    bm.prepare([(0, 1)])  # window 1: the next token sees only itself
    assert bm.num_released(0) == 2 and bm.block_table(0)[2] != RELEASED
    with pytest.raises(ValueError, match="released"):
        bm.truncate(0, 4)
    bm.audit()


def test_no_window_releases_nothing():
    bm = BlockManager(16, BS)
    bm.prepare([(0, 30)])
    bm.prepare([(0, 1)])
    assert bm.num_released(0) == 0 and RELEASED not in bm.block_table(0)
