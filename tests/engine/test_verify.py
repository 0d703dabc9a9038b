"""Prompt lookup and the verification of guesses: greedy keeps greedy, sampling keeps p."""

import math

import pytest
import torch
from gptserve.engine.sampler import SampleRow, SamplingParams
from gptserve.engine.verify import propose_ngram, verify


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


# Logits (4, 6) for three guesses and the bonus position, each position's distribution its own
LOGITS = torch.tensor(
    [
        [2.0, 1.2, 0.9, 0.3, -0.4, -1.0],
        [0.6, 2.2, 1.0, 0.1, 0.0, -0.7],
        [1.5, 1.4, 0.2, 0.8, -0.3, 0.5],
        [0.3, 0.9, 1.8, 1.1, -0.2, 0.6],
    ]
)
GUESSES = [0, 1, 1]  # a repeated guess: the penalties at position 2 count both earlier ones
PROMPT = [3, 5]


def _expected(position: int, params: SamplingParams) -> list[float]:
    """The distribution the plain sampler draws from at `position`, computed by hand: bias,
    frequency/presence then repetition penalties (the guesses before it count as output),
    temperature, min-p, top-k, top-p."""
    output = GUESSES[:position]
    z = LOGITS[position].tolist()
    for t, bias in params.logit_bias.items():
        z[t] += bias
    for t in set(output):
        z[t] -= params.frequency_penalty * output.count(t) + params.presence_penalty
    for t in set(PROMPT + output):
        z[t] = z[t] / params.repetition_penalty if z[t] > 0 else z[t] * params.repetition_penalty
    weights = [math.exp(v / params.temperature) for v in z]
    probs = [w / sum(weights) for w in weights]
    kept = [t for t, p in enumerate(probs) if p >= params.min_p * max(probs)]
    kept.sort(key=lambda t: -probs[t])
    if params.top_k > 0:
        kept = kept[: params.top_k]
    mass, nucleus = sum(probs[t] for t in kept), []
    for t in kept:
        if params.top_p < 1 and sum(probs[u] for u in nucleus) / mass >= params.top_p:
            break
        nucleus.append(t)
    total = sum(probs[t] for t in nucleus)
    return [probs[t] / total if t in nucleus else 0.0 for t in range(len(probs))]


def _chi_square_bound(df: int, z: float = 4.75) -> float:
    """The chi-square value a correct sampler exceeds with probability about 1e-6 (z = 4.75
    standard deviations; the Wilson-Hilferty approximation)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.fixture
def one_thread():
    """Tensors of a few elements: a thread pool's wake-up costs more than the work (10x here)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 0.5},
        {"temperature": 1.6, "top_k": 3},
        {"temperature": 0.8, "top_p": 0.6},
        {"temperature": 1.3, "min_p": 0.3},
        {"temperature": 0.7, "presence_penalty": 0.8, "frequency_penalty": 0.5},
        {"temperature": 1.1, "repetition_penalty": 1.8, "logit_bias": {4: 1.0}},
    ],
    ids=["temperature", "top-k", "top-p", "min-p", "presence-frequency", "repetition-bias"],
)
def test_each_kept_token_follows_the_processed_distribution_at_its_position(params, one_thread):
    params = SamplingParams(**params)
    row = SampleRow(params, PROMPT, [], torch.Generator().manual_seed(3), eos_token=None)
    counts = torch.zeros(len(LOGITS), LOGITS.shape[1])  # (positions, V)
    trials = 0
    while counts[-1].sum() < 400:  # the bonus position, reached only when every guess is kept
        tokens = verify(LOGITS, row, GUESSES).tokens  # the accepted guesses, then one more
        counts[torch.arange(len(tokens)), torch.tensor(tokens)] += 1
        trials += 1
        assert trials < 20_000, "the guesses are rarely all kept: choose likelier ones"
    for position in range(len(LOGITS)):
        # given the guesses before it were kept, the token at a position is drawn from p there
        p = torch.tensor(_expected(position, params))
        seen = counts[position]
        n = float(seen.sum())
        assert seen[p == 0].sum() == 0, f"position {position}: truncated tokens drawn {seen}"
        support = p > 0
        chi2 = float(((seen[support] - n * p[support]) ** 2 / (n * p[support])).sum())
        bound = _chi_square_bound(int(support.sum()) - 1) if support.sum() > 1 else 0.0
        assert chi2 <= bound, (position, (seen / n).tolist(), p.tolist(), chi2, bound)
