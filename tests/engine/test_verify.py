"""Prompt lookup and the verification of guesses: greedy keeps greedy, sampling keeps p."""

import pytest
import torch

from engine.sampler import SampleRow, SamplingParams
from engine.verify import propose_ngram, verify


def test_prompt_lookup_proposes_what_followed_the_longest_latest_match():
    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 7, 1, 2, 3]
    assert propose_ngram(tokens, 3) == [4, 5, 7]  # "1 2 3" last followed by 4 5 7
    assert propose_ngram(tokens, 10) == [4, 5, 7, 1, 2, 3]  # runs to the end of the sequence
    assert propose_ngram([5, 6, 7, 8], 2) == []  # nothing repeats
    assert propose_ngram([5, 6, 5], 2) == [6, 5]  # a one-token match
    assert propose_ngram([1, 2, 1, 2], 0) == []


def _row(**params) -> SampleRow:
    return SampleRow(SamplingParams(**params), [0], [], None, eos_token=None)


def test_greedy_keeps_the_guesses_up_to_the_first_non_argmax_then_the_argmax():
    logits = torch.full((4, 10), -5.0)
    for pos, best in enumerate([3, 4, 7, 1]):
        logits[pos, best] = 5.0
    out = verify(logits, _row(temperature=0, logprobs=2), [3, 4, 8])
    assert out.tokens == [3, 4, 7] and out.num_accepted == 2
    assert out.top_ids[2][0] == 7 and len(out.logprobs) == 3
    out = verify(logits, _row(temperature=0), [3, 4, 7])  # all right: the bonus token too
    assert out.tokens == [3, 4, 7, 1]


def test_penalties_apply_per_position_with_earlier_guesses_counted():
    logits = torch.zeros(3, 6)
    logits[:, 2] = 1.0  # token 2 is best everywhere, but a repeat of it is penalised below 0.5
    logits[:, 5] = 0.5
    out = verify(logits, _row(temperature=0, presence_penalty=1.0), [2, 5])
    # after guess 2, token 2 scores 0.0 < 0.5: the argmax is 5; after both, 2 and 5 are penalised
    assert out.tokens == [2, 5, 0] and out.num_accepted == 2


@pytest.mark.parametrize("guess", [0, 3], ids=["likely-guess", "unlikely-guess"])
def test_sampled_tokens_keep_the_model_distribution(guess):
    torch.manual_seed(0)
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    logits = p.log().expand(2, 5).clone()  # the same distribution at both positions
    row = SampleRow(
        SamplingParams(temperature=1.0), [0], [], torch.Generator().manual_seed(1), None
    )
    trials = 6000
    first = torch.zeros(5)
    for _ in range(trials):
        first[verify(logits, row, [guess]).tokens[0]] += 1
    # the first kept token is distributed as p whatever the guess; 5 sigma of a binomial
    sigma = (p * (1 - p) / trials).sqrt()
    assert ((first / trials - p).abs() < 5 * sigma).all(), first / trials


def _naive_lookup(tokens: list[int], k: int, max_n: int = 3) -> list[int]:
    for n in range(min(max_n, len(tokens) - 1), 0, -1):
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == tokens[-n:]:
                return tokens[start + n : start + n + k]
    return []


def test_prompt_lookup_agrees_with_a_plain_search_whatever_the_token_bytes():
    gen = torch.Generator().manual_seed(0)
    for _ in range(300):
        # few distinct tokens, some sharing bytes across token boundaries (256, 1, 65536, ...)
        alphabet = torch.tensor([0, 1, 256, 65536, 257, 50256])
        n = int(torch.randint(2, 40, (1,), generator=gen))
        tokens = alphabet[torch.randint(0, 6, (n,), generator=gen)].tolist()
        assert propose_ngram(tokens, 4) == _naive_lookup(tokens, 4), tokens
