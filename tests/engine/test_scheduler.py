"""The scheduler's StepPlan: kinds, token counts, logits rows, guesses and preemptions per step."""

from __future__ import annotations

import math

import pytest
from gptserve.engine.block_manager import BlockManager
from gptserve.engine.sampler import SamplingParams
from gptserve.engine.scheduler import Scheduler
from gptserve.engine.sequence import Sequence
from gptserve.engine.step_plan import StepKind, StepPlan
from gptserve.model import get_tokenizer

TOK = get_tokenizer()
BLOCK = 4


def make_seq(seq_id: int, prompt: list[int], **params: object) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", 0, prompt, SamplingParams(**params), TOK)


def play(cache: BlockManager, plan: StepPlan, next_token: int = 99) -> None:
    """What the engine does with a plan, without a model: cache the tokens, append a token to
    every sequence whose chunk samples (a verification accepts none of its guesses)."""
    cache.prepare([(p.seq.seq_id, p.num_tokens) for p in plan.scheduled])
    for part in plan.scheduled:
        seq = part.seq
        if part.kind is StepKind.VERIFY:
            cache.truncate(seq.seq_id, seq.num_cached + 1)
            seq.num_cached += 1
        else:
            seq.num_cached += part.num_tokens
        if part.samples:
            seq.token_ids.append(next_token)


def decoding(scheduler: Scheduler, *seqs: Sequence) -> None:
    """Prefill seqs in one step and sample their first tokens: they decode from then on."""
    for seq in seqs:
        scheduler.add(seq)
    plan = scheduler.schedule()
    assert [p.kind for p in plan.scheduled] == [StepKind.PREFILL] * len(seqs)
    play(scheduler.blocks, plan)
    assert all(s.pending == 1 for s in seqs)


def test_a_decode_a_verification_and_a_prefill_chunk():
    cache = BlockManager(32, BLOCK)
    scheduler = Scheduler(cache, max_num_seqs=4, max_batch_tokens=8)
    a, b = make_seq(0, [1, 2, 3]), make_seq(1, [4, 5, 6])
    decoding(scheduler, a, b)
    c = make_seq(2, list(range(10, 20)))  # ten prompt tokens: 3 fit next to 1 + 4
    scheduler.add(c)

    plan = scheduler.schedule({b.seq_id: [7, 8, 9]})

    assert [p.seq for p in plan.scheduled] == [a, b, c] and plan.preempted == []
    assert [p.kind for p in plan.scheduled] == [StepKind.DECODE, StepKind.VERIFY, StepKind.PREFILL]
    assert [p.num_tokens for p in plan.scheduled] == [1, 4, 3] and plan.num_tokens == 8
    pa, pb, pc = plan.scheduled
    assert pa.input_ids() == [99] and pb.input_ids() == [99, 7, 8, 9]
    assert pc.input_ids() == [10, 11, 12]
    assert pb.guesses == [7, 8, 9] and pa.guesses == [] and pc.guesses == []
    # the decode's one row, then a row for each of the verification's positions; the chunk that
    # ends inside the prompt gets none
    assert plan.logits_positions == [0, 1, 2, 3, 4]
    assert (pa.rows, pb.rows, pc.num_rows) == (slice(0, 1), slice(1, 5), 0)
    assert (pa.samples, pb.samples, pc.samples) == (True, True, False)
    assert pa.last_row == 0 and pb.last_row == 4

    play(cache, plan)  # the prompt's last 7 tokens fill the next step after two decodes
    plan = scheduler.schedule()
    assert [(p.kind, p.num_tokens) for p in plan.scheduled] == [
        (StepKind.DECODE, 1), (StepKind.DECODE, 1), (StepKind.PREFILL, 6)
    ]  # fmt: skip
    assert plan.logits_positions == [0, 1] and not plan.scheduled[2].samples
    play(cache, plan)
    plan = scheduler.schedule()
    assert plan.logits_positions == [0, 1, 2] and plan.scheduled[2].samples
    assert plan.scheduled[2].kind is StepKind.PREFILL and plan.scheduled[2].num_tokens == 1


def test_guesses_are_cut_to_the_token_budget_and_kept_only_for_their_step():
    cache = BlockManager(32, BLOCK)
    scheduler = Scheduler(cache, max_num_seqs=4, max_batch_tokens=4)
    a, b = make_seq(0, [1, 2]), make_seq(1, [3, 4])
    decoding(scheduler, a, b)
    offered = {b.seq_id: [5, 6, 7, 8, 9]}

    plan = scheduler.schedule(offered)

    pa, pb = plan.scheduled
    assert pa.kind is StepKind.DECODE and pb.kind is StepKind.VERIFY
    assert pb.num_tokens == 3 and pb.guesses == [5, 6] and plan.num_tokens == 4
    assert offered == {b.seq_id: [5, 6, 7, 8, 9]}  # the proposer's answer is not changed
    # the first verification takes the budget: the second has no room left and decodes plainly
    scheduler.max_batch_tokens = 2
    plan = scheduler.schedule({a.seq_id: [5], b.seq_id: [6]})
    assert [(p.seq, p.kind, p.num_tokens, p.guesses) for p in plan.scheduled] == [
        (a, StepKind.VERIFY, 2, [5]), (b, StepKind.DECODE, 1, [])
    ]  # fmt: skip
    assert plan.logits_positions == [0, 1, 2]
    scheduler.max_batch_tokens = 4  # guesses are the step's: the next step has none
    assert [p.kind for p in scheduler.schedule().scheduled] == [StepKind.DECODE] * 2


def test_guesses_go_before_any_sequence_is_preempted():
    cache = BlockManager(3, BLOCK)
    scheduler = Scheduler(cache, max_num_seqs=4, max_batch_tokens=16)
    a, b = make_seq(0, [1, 2, 3]), make_seq(1, [4, 5, 6])
    decoding(scheduler, a, b)  # each holds one block with a slot left
    assert cache.num_free_blocks == 1

    plan = scheduler.schedule({a.seq_id: [7, 8, 9, 10, 11, 12]})  # 7 tokens: two more blocks

    assert plan.preempted == []
    assert [(p.kind, p.num_tokens) for p in plan.scheduled] == [(StepKind.DECODE, 1)] * 2
    assert plan.logits_positions == [0, 1]


def test_preempted_sequences_are_named_and_left_out():
    cache = BlockManager(3, BLOCK)
    scheduler = Scheduler(cache, max_num_seqs=4, max_batch_tokens=16)
    a, b = make_seq(0, [1, 2, 3]), make_seq(1, [4, 5, 6])
    decoding(scheduler, a, b)
    play(cache, scheduler.schedule())  # both blocks are full: the next decodes need two, 1 is free

    plan = scheduler.schedule()

    assert plan.preempted == [b] and [p.seq for p in plan.scheduled] == [a]
    assert list(scheduler.waiting) == [b] and b.num_cached == 0 and not cache.holds(b.seq_id)
    assert plan.scheduled[0].kind is StepKind.DECODE


def test_prompt_logprobs_get_a_row_for_every_prompt_position():
    cache = BlockManager(32, BLOCK)
    scheduler = Scheduler(cache, max_num_seqs=4, max_batch_tokens=4)
    seq = make_seq(0, [1, 2, 3, 4, 5, 6], prompt_logprobs=1)
    scheduler.add(seq)

    first = scheduler.schedule()
    (part,) = first.scheduled
    assert part.kind is StepKind.PREFILL and part.scores_prompt and not part.samples
    assert first.logits_positions == [0, 1, 2, 3] and part.rows == slice(0, 4)
    play(cache, first)
    (part,) = scheduler.schedule().scheduled
    assert part.num_tokens == 2 and part.rows == slice(0, 2) and part.samples
    assert part.scores_prompt and part.last_row == 1


def test_a_one_token_prompt_is_a_prefill_and_a_bad_verification_is_refused():
    cache = BlockManager(8, BLOCK)
    scheduler = Scheduler(cache, max_num_seqs=4, max_batch_tokens=8)
    seq = make_seq(0, [1])
    scheduler.add(seq)
    (part,) = scheduler.schedule().scheduled
    assert part.kind is StepKind.PREFILL and part.samples and part.num_rows == 1
    with pytest.raises(ValueError, match="last token and its guesses"):
        StepPlan.build([(seq, 2, [5, 6])], [])


# ---- fairness between senders (SamplingParams.tenant) --------------------------------------


def run_until_first_token(scheduler: Scheduler, seq: Sequence, limit: int = 100) -> int:
    """Steps played until `seq` samples its first token."""
    for step in range(1, limit + 1):
        play(scheduler.blocks, scheduler.schedule())
        if seq.num_generated:
            return step
    raise AssertionError(f"no first token in {limit} steps")


def test_a_long_prompt_of_one_tenant_leaves_another_its_first_token_soon():
    """Tenant a's long prompts fill every step's budget; tenant b's short one, sent after them,
    is admitted and prefilled within a step or two, not after all of a's."""
    cache = BlockManager(1024, BLOCK)
    scheduler = Scheduler(cache, max_num_seqs=8, max_batch_tokens=16)
    longs = [make_seq(i, list(range(1, 161)), tenant="a") for i in range(4)]  # 10 steps each
    for seq in longs:
        scheduler.add(seq)
    play(cache, scheduler.schedule())
    short = make_seq(9, [5, 6, 7], tenant="b")
    scheduler.add(short)
    assert run_until_first_token(scheduler, short) <= 2
    assert all(s.num_cached > 0 for s in longs[:1])  # a's prompt went on beside it


def test_one_tenant_alone_is_served_first_come_first_served():
    cache = BlockManager(1024, BLOCK)
    scheduler = Scheduler(cache, max_num_seqs=8, max_batch_tokens=16)
    first, second = make_seq(0, list(range(1, 41))), make_seq(1, [5, 6, 7])
    scheduler.add(first)
    scheduler.add(second)
    plan = scheduler.schedule()
    assert [p.seq for p in plan.scheduled] == [first]  # the whole budget, in arrival order


def test_tenants_are_admitted_in_turn():
    cache = BlockManager(1024, BLOCK)
    scheduler = Scheduler(cache, max_num_seqs=4, max_batch_tokens=64)
    a = [make_seq(i, [1, 2, 3], tenant="a") for i in range(6)]
    b = [make_seq(10 + i, [1, 2, 3], tenant="b") for i in range(2)]
    for seq in [*a, *b]:
        scheduler.add(seq)
    plan = scheduler.schedule()
    admitted = [p.seq for p in plan.scheduled]
    assert admitted == [a[0], b[0], a[1], b[1]]  # four slots: two each, not a's first four


def test_what_fits_goes_ahead_of_what_does_not_but_not_forever():
    """A sequence too large for the free blocks lets smaller ones behind it in, at most
    MAX_PASSED_OVER times; after that nothing passes it until it fits."""
    from gptserve.engine import scheduler as module

    cache = BlockManager(13, BLOCK)  # 52 tokens
    scheduler = Scheduler(cache, max_num_seqs=64, max_batch_tokens=64)
    hog = make_seq(0, list(range(1, 33)))  # 8 blocks, decoding
    decoding(scheduler, hog)
    big = make_seq(1, list(range(1, 25)))  # 6 blocks: does not fit beside the hog
    scheduler.add(big)
    small = make_seq(2, [1, 2, 3])
    scheduler.add(small)
    plan = scheduler.schedule()
    assert small in [p.seq for p in plan.scheduled] and big in scheduler.waiting
    assert big.passed_over == 1
    big.passed_over = module.MAX_PASSED_OVER
    later = make_seq(3, [1, 2, 3])  # would fit: 1 block, 3 free
    scheduler.add(later)
    plan = scheduler.schedule()
    assert later in scheduler.waiting and later not in [p.seq for p in plan.scheduled]
    big.passed_over = 0
    plan = scheduler.schedule()
    assert later in [p.seq for p in plan.scheduled]  # the same step, once big may be passed


def paced_steps(scheduler: Scheduler, steps: int, decode_s: float, turn_s: float) -> list[dict]:
    """Play `steps` steps, reporting each as taking decode_s, or turn_s when another tenant's
    prompt chunk ran in it (seq_id 1's); each step's {seq_id: tokens}."""
    played = []
    for _ in range(steps):
        plan = scheduler.schedule()
        tokens = {p.seq.seq_id: p.num_tokens for p in plan.scheduled}
        play(scheduler.blocks, plan)
        scheduler.record_step(turn_s if tokens.get(1) else decode_s)
        played.append(tokens)
    return played


def test_a_prompt_beside_another_tenants_decodes_takes_turns_paced_by_their_time():
    """While tenant b decodes, tenant a's long prompt takes SHARED_STEP_PREFILL tokens in a step,
    and its next turn waits until decode-only steps have paid back the time the turn added: b's
    time per token stays within STREAM_SLOWDOWN times a decode step's, however costly a's chunks
    are. b's own prompt is not held."""
    from gptserve.engine import scheduler as module

    cache = BlockManager(1024, BLOCK)
    scheduler = Scheduler(cache, max_num_seqs=8, max_batch_tokens=64)
    chat = make_seq(0, [5, 6, 7], tenant="b")
    decoding(scheduler, chat)
    bulk = make_seq(1, list(range(1, 401)), tenant="a")
    scheduler.add(bulk)
    decode_s = 0.005
    for turn_s in [0.045, 0.006]:
        # the decode-only steps that pay off a turn's time beyond a decode step's
        gap = math.ceil((turn_s - decode_s) / ((module.STREAM_SLOWDOWN - 1) * decode_s) - 1e-9)
        steps = paced_steps(scheduler, 4 * (gap + 1), decode_s, turn_s)
        assert all(step[0] == 1 for step in steps)  # b decodes every step
        turns = [i for i, step in enumerate(steps) if step.get(1)]
        assert all(steps[i][1] == module.SHARED_STEP_PREFILL for i in turns)
        gaps = [b - a - 1 for a, b in zip(turns, turns[1:])]
        # (the very first turn, before any decode-only step was timed, owes its whole time)
        assert len(gaps) >= 2 and gaps[1:] == [gap] * (len(gaps) - 1)
        seconds = sum(turn_s if step.get(1) else decode_s for step in steps[turns[0] :])
        assert seconds / len(steps[turns[0] :]) <= module.STREAM_SLOWDOWN * decode_s + 1e-9
    own = make_seq(2, list(range(1, 201)), tenant="b")  # the decoding tenant's own prompt
    scheduler.add(own)
    plan = scheduler.schedule()
    assert {p.seq.seq_id: p.num_tokens for p in plan.scheduled}[2] > module.SHARED_STEP_PREFILL


def test_with_api_keys_a_steps_prompt_chunks_are_bounded_by_their_cost():
    """A lone tenant's prompt takes TENANT_STEP_PREFILL tokens a step at its start and fewer deep
    into it (each token attends to every key before it), so a step that another key's request
    arrives during ends soon; without keys (no tenant) the whole budget, as before."""
    from gptserve.engine import scheduler as module

    n, unit, most = 4 * module.KEYS_PER_TOKEN_COST, module.KEYS_PER_TOKEN_COST, 1024
    for tenant in ["a", None]:
        cache = BlockManager(n // BLOCK + 8, BLOCK)
        scheduler = Scheduler(cache, max_num_seqs=8, max_batch_tokens=1024)
        seq = make_seq(0, list(range(1, n + 1)), tenant=tenant)
        scheduler.add(seq)
        chunks = []
        while seq.pending > 1:
            plan = scheduler.schedule()
            chunks.append((seq.num_cached, plan.scheduled[0].num_tokens))
            play(cache, plan)
        for start, tokens in chunks[:-1]:  # (the last takes what is left)
            if tenant is None:
                assert tokens == most
            else:
                assert tokens == int(module.TENANT_STEP_PREFILL / (1 + start / unit))
        if tenant is not None:  # 128 tokens a step at the start, 32 at three units deep
            assert chunks[0] == (0, module.TENANT_STEP_PREFILL)
            assert min(t for _, t in chunks[:-1]) <= module.TENANT_STEP_PREFILL // 4
        assert sum(t for _, t in chunks) == n  # the whole prompt, nothing lost
