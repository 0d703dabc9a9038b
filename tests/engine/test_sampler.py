"""The batched sampler on hand-built logits."""

import math

import pytest
import torch
from gptserve.engine.errors import RequestError
from gptserve.engine.sampler import (
    SampleRow,
    SamplingParams,
    apply_penalties,
    draw_distribution,
    sample,
)


def _row(**kw) -> SampleRow:
    prompt = kw.pop("prompt", [])
    output = kw.pop("output", [])
    gen = kw.pop("gen", None)
    return SampleRow(SamplingParams(**kw), prompt, output, gen, eos_token=kw.get("eos", 4))


def _draws(logits: torch.Tensor, n: int = 400, **kw) -> set[int]:
    gen = torch.Generator().manual_seed(0)
    return {sample(logits[None].clone(), [_row(gen=gen, **kw)]).tokens[0] for _ in range(n)}


LOGITS = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03]))


def test_greedy_picks_argmax():
    out = sample(LOGITS[None], [_row(temperature=0, logprobs=0)])
    assert out.tokens == [0]
    assert math.isclose(out.logprobs[0], math.log(0.5), rel_tol=1e-5)


def test_a_batch_that_reports_no_logprob_computes_none_and_picks_the_same():
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(0))
    logits[1, 5] = float("nan")
    quiet = sample(logits, [_row(temperature=0) for _ in range(4)])
    told = sample(logits, [_row(temperature=0, logprobs=0) for _ in range(4)])
    assert quiet.tokens == told.tokens == logits.argmax(-1).tolist()
    assert all(math.isnan(lp) for lp in quiet.logprobs) and quiet.top_ids == [[]] * 4
    assert not math.isnan(told.logprobs[0])


def test_top_k_limits_choices():
    assert _draws(LOGITS, top_k=2) == {0, 1}


def test_top_p_limits_choices():
    # 0.5 + 0.25 reaches 0.7: the third token is never drawn
    assert _draws(LOGITS, top_p=0.7) == {0, 1}
    assert _draws(LOGITS, top_p=0.8) == {0, 1, 2}


def test_min_p_limits_choices():
    # floor = 0.3 * 0.5 = 0.15: tokens 0, 1, 2 survive
    assert _draws(LOGITS, min_p=0.3) == {0, 1, 2}


def test_temperature_sharpens_and_flattens():
    gen = torch.Generator().manual_seed(0)
    cold = [
        sample(LOGITS[None].clone(), [_row(temperature=0.05, gen=gen)]).tokens[0]
        for _ in range(200)
    ]
    hot = [
        sample(LOGITS[None].clone(), [_row(temperature=5.0, gen=gen)]).tokens[0]
        for _ in range(2000)
    ]
    assert cold.count(0) == 200
    freq4 = hot.count(4) / len(hot)
    assert 0.1 < freq4 < 0.3  # near-uniform at high temperature (vs 0.03 at t=1)


def test_sampling_follows_the_distribution():
    gen = torch.Generator().manual_seed(1)
    draws = [sample(LOGITS[None].clone(), [_row(gen=gen)]).tokens[0] for _ in range(4000)]
    assert abs(draws.count(0) / 4000 - 0.5) < 0.03
    assert abs(draws.count(1) / 4000 - 0.25) < 0.03


def test_unseeded_rows_of_one_batch_follow_the_distribution():
    torch.manual_seed(2)
    rows = [_row() for _ in range(4000)]
    rows[::2] = [_row(gen=torch.Generator().manual_seed(i)) for i in range(2000)]  # mixed in
    tokens = sample(LOGITS[None].repeat(4000, 1), rows).tokens
    for part in (tokens[1::2], tokens[::2]):  # unseeded rows, seeded rows
        for token, p in enumerate([0.5, 0.25, 0.15, 0.07, 0.03]):
            assert abs(part.count(token) / len(part) - p) < 0.035, (token, part.count(token))


def test_logit_bias_forces_and_bans():
    assert sample(LOGITS[None], [_row(temperature=0, logit_bias={3: 100.0})]).tokens == [3]
    assert _draws(LOGITS, logit_bias={0: -100.0, 1: -100.0}) <= {2, 3, 4}


def test_penalties():
    logits = torch.tensor([[2.0, 1.0, -1.0, 0.0]])
    rep = apply_penalties(logits.clone(), [_row(repetition_penalty=2.0, prompt=[0], output=[2])])
    assert rep.tolist() == [[1.0, 1.0, -2.0, 0.0]]
    freq = apply_penalties(
        logits.clone(), [_row(presence_penalty=0.5, frequency_penalty=0.25, output=[1, 1, 3])]
    )
    assert freq.tolist() == [[2.0, 1.0 - 0.5 - 0.5, -1.0, 0.0 - 0.5 - 0.25]]


def test_min_tokens_bans_eos_and_stop_ids():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0, 9.0]])
    rows = [_row(temperature=0, min_tokens=2, max_tokens=5, output=[1], stop_token_ids=[3])]
    out = apply_penalties(logits.clone(), rows)
    assert out[0, 4] == float("-inf") and out[0, 3] == float("-inf")
    rows = [_row(temperature=0, min_tokens=1, max_tokens=5, output=[1])]
    assert apply_penalties(logits.clone(), rows)[0, 4] == 9.0


def test_logprobs_and_top_alternatives_per_row():
    logits = torch.stack([LOGITS, LOGITS.flip(0)])
    out = sample(logits, [_row(temperature=0, logprobs=3), _row(temperature=0, logprobs=0)])
    assert out.tokens == [0, 4]
    assert out.top_ids[0] == [0, 1, 2] and out.top_ids[1] == []
    assert [round(math.exp(x), 4) for x in out.top_logprobs[0]] == [0.5, 0.25, 0.15]


def test_mixed_batch_rows_are_independent():
    gen_alone = torch.Generator().manual_seed(7)
    alone = [
        sample(LOGITS[None].clone(), [_row(gen=gen_alone, top_k=3)]).tokens[0] for _ in range(50)
    ]
    gen_mixed = torch.Generator().manual_seed(7)
    mixed = []
    for _ in range(50):
        rows = [_row(temperature=0), _row(gen=gen_mixed, top_k=3), _row(temperature=2.0, top_p=0.5)]
        mixed.append(sample(torch.stack([LOGITS] * 3), rows).tokens[1])
    assert alone == mixed


def test_a_row_without_truncation_keeps_its_whole_distribution_beside_a_top_p_row():
    # GPT-2's vocabulary: in float32 the sorted cumulative sum reaches 1 before the tail, which
    # once cut ~3000 tokens of the untruncated row whenever another row of the batch used top-p
    logits = 3 * torch.randn(3, 50257, generator=torch.Generator().manual_seed(0))
    rows = [_row(), _row(top_p=0.5), _row(top_k=40, temperature=0.7)]
    together = draw_distribution(logits.clone(), rows)  # (3, V)
    for i, row in enumerate(rows):
        alone = draw_distribution(logits[i : i + 1].clone(), [row])[0]
        assert torch.equal(together[i], alone), i
    assert bool((together[0] > 0).all())  # every token of the free row can still be drawn
    assert 1 < int((together[1] > 0).sum()) < 50257 and int((together[2] > 0).sum()) == 40


@pytest.mark.parametrize(
    "kw,param",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"logit_bias": {99: 1.0}}, "logit_bias"),
        ({"logit_bias": {1: 500.0}}, "logit_bias"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [50]}, "stop_token_ids"),
        ({"logprobs": 21}, "logprobs"),
        ({"n": 0}, "n"),
    ],
)
def test_validation_names_the_field(kw, param):
    with pytest.raises(RequestError) as err:
        SamplingParams(**kw).validate(vocab_size=10)
    assert err.value.param == param


def test_sampling_leaves_the_callers_logits_as_they_were():
    logits = torch.randn(2, 10)
    before = logits.clone()
    rows = [_row(temperature=0.7, top_k=3, repetition_penalty=1.3, logit_bias={1: 5.0}),
            _row(temperature=0, frequency_penalty=0.5, logprobs=0)]  # fmt: skip
    rows[1].output_ids.extend([2, 2, 3])
    out = sample(logits, rows)
    assert torch.equal(logits, before)
    penalised = before[1].clone()  # row 1: frequency penalty 0.5 for each earlier use
    penalised[2] -= 1.0
    penalised[3] -= 0.5
    assert out.tokens[1] == int(penalised.argmax())
    expected = torch.log_softmax(penalised, dim=-1)[out.tokens[1]]
    assert math.isclose(out.logprobs[1], float(expected), rel_tol=1e-5, abs_tol=1e-6)
