"""llama.cpp's samplers (typical_p, XTC, DRY), each against a plain, slow implementation of its
definition written here; rows with and without them in one batch; seeded output with them alone
and in a batch under `--batch-invariant`."""

from __future__ import annotations

import math
import random
import time

import pytest
import torch
from gptserve.engine import sampler
from gptserve.engine.engine import Engine, EngineConfig
from gptserve.engine.errors import RequestError
from gptserve.engine.loader import load_for_inference
from gptserve.engine.sampler import (
    DRY_SEQUENCE_BREAKERS,
    DryBreakerIndex,
    DryBreakers,
    SampleRow,
    SamplingParams,
    apply_penalties,
    draw_distribution,
    sample,
    truncate,
)
from gptserve.model import GPT, ModelConfig, save_checkpoint

FLOAT32_MAX_LOG = 88.7228391
FLOAT32_MAX = 3.4028234663852886e38


def _row(gen: torch.Generator | None = None, context: list[int] | None = None, **kw) -> SampleRow:
    return SampleRow(SamplingParams(**kw), list(context or []), [], gen)


def _random_logits(rows: int, vocab: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def _probs64(logits: torch.Tensor) -> list[float]:
    """A row's probabilities in float64; masked (-inf) tokens are 0."""
    return torch.softmax(logits.double(), dim=-1).tolist()


def _kept(row: torch.Tensor) -> set[int]:
    return {i for i, x in enumerate(row.tolist()) if x > -math.inf}


# ---- reference implementations, straight from the definitions ------------------------------------


def ref_top_k(p: list[float], keep: set[int], k: int) -> set[int]:
    if k <= 0:
        return keep
    return set(sorted(keep, key=lambda i: -p[i])[:k])


def ref_top_p(p: list[float], keep: set[int], top_p: float) -> set[int]:
    """The smallest set of the most probable kept tokens whose (renormalised) mass reaches top_p."""
    if top_p >= 1:
        return keep
    total = sum(p[i] for i in keep)
    out, mass = set(), 0.0
    for i in sorted(keep, key=lambda i: -p[i]):
        if mass >= top_p:
            break
        out.add(i)
        mass += p[i] / total
    return out


def ref_typical(p: list[float], keep: set[int], typical_p: float) -> set[int]:
    """The smallest set of kept tokens, taken by |-log q - H| ascending (q renormalised over the
    kept tokens, H its entropy; ties: the more probable first), whose mass reaches typical_p."""
    if typical_p >= 1:
        return keep
    total = sum(p[i] for i in keep)
    q = {i: p[i] / total for i in keep}
    entropy = -sum(v * math.log(v) for v in q.values() if v > 0)
    order = sorted(keep, key=lambda i: (abs(-math.log(q[i]) - entropy), -q[i]))
    out, mass = set(), 0.0
    for i in order:
        if mass >= typical_p:
            break
        out.add(i)
        mass += q[i]
    return out


def ref_xtc(p: list[float], keep: set[int], threshold: float) -> set[int]:
    """Every kept token at least `threshold` probable (renormalised) goes but the least probable of
    them, when at least two are."""
    total = sum(p[i] for i in keep)
    top = [i for i in keep if p[i] / total >= threshold]
    if len(top) < 2:
        return keep
    least = min(p[i] for i in top)
    return keep - {i for i in top if p[i] > least}


def ref_dry(context: list[int], params: SamplingParams) -> dict[int, float]:
    """For each token c: the longest n (at most the tokens after the last breaker) such that the
    window's last n tokens, then c, occur earlier in the window; n >= allowed costs c
    multiplier * base ** (n - allowed), unless c is a single-token breaker."""
    last_n = params.dry_penalty_last_n
    if params.dry_multiplier == 0 or last_n == 0:
        return {}
    window = context[-last_n:] if last_n > 0 else context
    size = len(window)
    breakers = params.dry_breakers or DryBreakers()
    limit = size
    for end in range(size):  # the last breaker token or whole breaker sequence ends at `end`
        if window[end] in breakers.ids:
            limit = min(limit, size - 1 - end)
        for seq in breakers.sequences:
            if end + 1 >= len(seq) and tuple(window[end + 1 - len(seq) : end + 1]) == seq:
                limit = min(limit, size - 1 - end)
    out = {}
    for c in set(window):
        best = -1
        for n in range(limit + 1):
            suffix = window[size - n :] if n else []
            # window[i] follows an earlier copy of the suffix; the window's first token follows
            # nothing in it, so not even an empty suffix (llama.cpp's rule, seen at allowed 0)
            for i in range(max(n, 1), size):
                if window[i] == c and window[i - n : i] == suffix:
                    best = max(best, n)
        allowed = params.dry_allowed_length
        if best >= allowed and c not in breakers.ids:
            exponent = min(best - allowed, math.floor(FLOAT32_MAX_LOG / math.log(params.dry_base)))
            out[c] = min(params.dry_multiplier * params.dry_base**exponent, FLOAT32_MAX)
    return out


# ---- typical_p ---------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(12))
def test_typical_p_keeps_the_reference_set(seed: int) -> None:
    rng = random.Random(seed)
    vocab = rng.choice([7, 50, 300])
    logits = _random_logits(1, vocab, seed, scale=rng.choice([0.5, 2.0, 5.0]))
    typical_p = rng.choice([0.05, 0.2, 0.5, 0.9, 0.99])
    temperature = rng.choice([1.0, 0.7, 1.5])
    out = draw_distribution(logits.clone(), [_row(typical_p=typical_p, temperature=temperature)])
    p = _probs64(logits[0] / temperature)
    assert {i for i, x in enumerate(out[0].tolist()) if x > 0} == ref_typical(
        p, set(range(vocab)), typical_p
    )


def test_typical_p_can_drop_the_most_probable_token() -> None:
    # a token of probability 0.4 over a flat tail of 1000: its surprise (0.9 nats) is further
    # from the entropy (4.8) than a tail token's (7.4)
    logits = torch.cat([torch.tensor([6.5]), torch.linspace(0, 0.01, 1000)])[None]  # no ties
    p = _probs64(logits[0])
    expected = ref_typical(p, set(range(1001)), 0.5)
    assert 0 not in expected
    assert _kept(truncate(logits.clone(), [_row(typical_p=0.5)])[0]) == expected


@pytest.mark.parametrize("seed", range(12))
def test_every_cut_in_order_matches_the_reference(seed: int) -> None:
    """min_p, top_k, typical_p, top_p and XTC together, each on what the one before left."""
    rng = random.Random(100 + seed)
    vocab = 200
    logits = _random_logits(1, vocab, 100 + seed, scale=rng.choice([1.0, 3.0]))
    kw = dict(
        min_p=rng.choice([0.0, 0.001, 0.02]),
        top_k=rng.choice([0, 5, 40]),
        typical_p=rng.choice([1.0, 0.3, 0.8]),
        top_p=rng.choice([1.0, 0.5, 0.95]),
        xtc_probability=rng.choice([0.0, 1.0]),
        xtc_threshold=rng.choice([0.02, 0.1]),
    )
    out = truncate(logits.clone(), [_row(**kw)])
    p = _probs64(logits[0])
    keep = {i for i in range(vocab) if p[i] >= kw["min_p"] * max(p)}
    keep = ref_top_k(p, keep, kw["top_k"])
    keep = ref_typical(p, keep, kw["typical_p"])
    keep = ref_top_p(p, keep, kw["top_p"])
    if kw["xtc_probability"]:
        keep = ref_xtc(p, keep, kw["xtc_threshold"])
    assert _kept(out[0]) == keep, kw


# ---- XTC -------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(12))
def test_xtc_keeps_the_reference_set(seed: int) -> None:
    rng = random.Random(200 + seed)
    vocab = rng.choice([5, 30, 100])
    logits = _random_logits(1, vocab, 200 + seed, scale=rng.choice([1.0, 2.0, 4.0]))
    threshold = rng.choice([0.0, 0.01, 0.05, 0.1, 0.2])
    out = truncate(logits.clone(), [_row(xtc_probability=1.0, xtc_threshold=threshold)])
    assert _kept(out[0]) == ref_xtc(_probs64(logits[0]), set(range(vocab)), threshold)


def test_xtc_removes_the_top_choices_but_the_least_of_them() -> None:
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.06, 0.04]]))
    out = truncate(logits.clone(), [_row(xtc_probability=1.0, xtc_threshold=0.1)])
    assert _kept(out[0]) == {2, 3, 4}
    # only one token reaches the threshold: nothing goes
    out = truncate(logits.clone(), [_row(xtc_probability=1.0, xtc_threshold=0.35)])
    assert _kept(out[0]) == {0, 1, 2, 3, 4}
    # tokens an earlier cut removed never count: with top_k 2 only 0 and 1 remain, 0 goes
    out = truncate(logits.clone(), [_row(xtc_probability=1.0, xtc_threshold=0.0, top_k=2)])
    assert _kept(out[0]) == {1}


def test_xtc_applies_when_the_rows_own_draw_is_below_its_probability() -> None:
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.06, 0.04]]))
    gen = torch.Generator().manual_seed(7)
    applied = 0
    for _ in range(200):
        twin = torch.Generator().manual_seed(0)
        twin.set_state(gen.get_state())
        expected = float(torch.rand(1, generator=twin)) < 0.3
        row = _row(gen, xtc_probability=0.3, xtc_threshold=0.1)
        kept = _kept(truncate(logits.clone(), [row])[0])
        assert kept == ({2, 3, 4} if expected else {0, 1, 2, 3, 4})
        assert torch.equal(gen.get_state(), twin.get_state())  # one draw, no more
        applied += expected
    assert 30 < applied < 90  # about 0.3 of 200


def test_xtc_above_half_or_at_zero_probability_is_off_and_draws_nothing() -> None:
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.06, 0.04]]))
    for kw in (dict(xtc_probability=1.0, xtc_threshold=0.51), dict(xtc_probability=0.0)):
        gen = torch.Generator().manual_seed(3)
        state = gen.get_state()
        out = truncate(logits.clone(), [_row(gen, **kw)])
        assert torch.equal(out, logits) and torch.equal(gen.get_state(), state)


# ---- DRY -------------------------------------------------------------------------------------


def _dry_rows(seed: int) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    cases = []
    for _ in range(25):
        alphabet = rng.choice([3, 5, 8])
        context = [rng.randrange(alphabet) for _ in range(rng.randrange(1, 60))]
        if rng.random() < 0.5:  # a repeated stretch, the case DRY is for
            start = rng.randrange(len(context))
            context += context[start : start + rng.randrange(2, 12)]
        ids = frozenset(rng.sample(range(alphabet), rng.choice([0, 0, 1])))
        seqs = tuple(
            {tuple(rng.randrange(alphabet) for _ in range(2))} if rng.random() < 0.3 else ()
        )
        params = SamplingParams(
            dry_multiplier=rng.choice([0.5, 0.8, 2.0]),
            dry_base=rng.choice([1.1, 1.75, 3.0, 1e30]),
            dry_allowed_length=rng.choice([0, 1, 2, 3]),
            dry_penalty_last_n=rng.choice([-1, -1, 1, 4, 17, 1000]),
            dry_breakers=DryBreakers(ids, seqs),
        )
        cases.append((context, params))
    return cases


@pytest.mark.parametrize("passes", [48, 2, 0], ids=["numpy", "numpy-then-z", "z"])
@pytest.mark.parametrize("seed", range(8))
def test_dry_adjusts_the_logits_as_the_reference(
    seed: int, passes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The runs found by numpy passes, by the Z-algorithm past a few of them, or by it alone."""
    monkeypatch.setattr(sampler, "DRY_NUMPY_PASSES", passes)
    cases = _dry_rows(seed)
    vocab = 8
    logits = _random_logits(len(cases), vocab, seed)
    rows = [SampleRow(params, context, []) for context, params in cases]
    out = apply_penalties(logits, rows)
    for i, (context, params) in enumerate(cases):
        expected = logits[i].clone()
        for token, penalty in ref_dry(context, params).items():
            expected[token] = logits[i, token] - torch.tensor(penalty, dtype=torch.float32)
        assert torch.equal(out[i], expected), (context, params)


def test_dry_on_llama_cpps_example() -> None:
    # a b c c b c y a b c: emitting c would make "a b c c" (3 -> 4), y "b c y" (2 -> 3); b only
    # "c b" (1 -> 2), within the allowed length of 2
    a, b, c, y = 1, 2, 3, 7
    params = SamplingParams(dry_multiplier=0.8, dry_base=1.75, dry_allowed_length=2)
    row = SampleRow(params, [a, b, c, c, b, c, y, a, b, c], [])
    out = apply_penalties(torch.zeros(1, 10), [row])[0]
    assert out[c] == pytest.approx(-0.8 * 1.75) and out[y] == pytest.approx(-0.8)
    assert out[[0, a, b, 4, 5, 6, 8, 9]].eq(0).all()


def test_dry_counts_the_prompt_and_the_output_and_stops_at_a_breaker() -> None:
    a, b, c, nl = 1, 2, 3, 9
    params = SamplingParams(dry_multiplier=1.0, dry_allowed_length=1)
    row = SampleRow(params, [a, b, c, a], [b])  # a b c a b: c would repeat "a b c"
    assert apply_penalties(torch.zeros(1, 10), [row])[0, c] == pytest.approx(-1.75)
    params.dry_breakers = DryBreakers(frozenset({nl}))
    row = SampleRow(params, [a, b, c, nl, a], [b])  # the newline ends the repetition's reach
    assert apply_penalties(torch.zeros(1, 10), [row])[0, c] == pytest.approx(-1.75)
    row = SampleRow(params, [a, b, c, a, nl, b], [])  # only "b" is after the breaker: 1 token
    assert apply_penalties(torch.zeros(1, 10), [row])[0, c] == pytest.approx(-1.0)
    row = SampleRow(params, [a, nl, a, nl, a], [])  # the breaker itself is never penalised
    assert apply_penalties(torch.zeros(1, 10), [row])[0].eq(0).all()
    last = SamplingParams(dry_multiplier=1.0, dry_allowed_length=1, dry_penalty_last_n=3)
    row = SampleRow(last, [a, b, c, 5, a, b], [])  # the first "a b c" is out of the last 3
    assert apply_penalties(torch.zeros(1, 10), [row])[0].eq(0).all()


def test_dry_on_a_long_repetition_costs_linear_time() -> None:
    """Thousands of tokens of one loop and no breaker: the Z-algorithm, not a pass per token."""
    params = SamplingParams(dry_multiplier=0.8, dry_allowed_length=2)
    context = list(range(20)) * 1000  # 20,000 tokens
    start = time.perf_counter()
    penalties = sampler.dry_penalties(context, params)
    assert time.perf_counter() - start < 2.0  # a pass per token: minutes
    cap = math.floor(FLOAT32_MAX_LOG / math.log(1.75))
    assert penalties == {0: 0.8 * 1.75**cap}


def test_a_huge_dry_penalty_leaves_the_logits_finite() -> None:
    params = SamplingParams(dry_multiplier=1e300, dry_base=1e30, dry_allowed_length=0)
    out = apply_penalties(torch.zeros(1, 4), [SampleRow(params, [1, 2, 1, 2, 1, 2], [])])[0]
    assert out[[1, 2]].eq(-FLOAT32_MAX).all() and out[[0, 3]].eq(0).all()


def test_breakers_resolve_to_every_token_that_contains_them(tok) -> None:
    index = DryBreakerIndex(tok)
    breakers = index.resolve(list(DRY_SEQUENCE_BREAKERS) + ["### Response"])
    expected = {
        i
        for i in range(tok.vocab_size)
        if any(s.encode() in tok.token_bytes(i) for s in DRY_SEQUENCE_BREAKERS)
    }
    assert breakers.ids == expected
    assert tok.encode("\n")[0] in breakers.ids and tok.encode(":")[0] in breakers.ids
    assert breakers.sequences == (tuple(tok.encode("### Response")),)
    assert index.resolve(["é"]).ids == {
        i for i in range(tok.vocab_size) if "é".encode() in tok.token_bytes(i)
    }
    for bad in (["x"] * 17, [""], ["x" * 33], "\n", [3], ["\ud800"]):
        with pytest.raises(RequestError) as err:
            index.resolve(bad)
        assert err.value.param == "dry_sequence_breakers"


# ---- validation ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("typical_p", 0.0), ("typical_p", 1.5), ("typical_p", math.nan),
        ("xtc_probability", -0.1), ("xtc_probability", 1.1),
        ("xtc_threshold", -0.1), ("xtc_threshold", 1.5),
        ("dry_multiplier", -1.0), ("dry_multiplier", math.inf),
        ("dry_base", 1.0), ("dry_base", 0.5),
        ("dry_allowed_length", -1), ("dry_allowed_length", 1.5),
        ("dry_penalty_last_n", -2),
        ("dry_sequence_breakers", [""]), ("dry_sequence_breakers", ["x"] * 17),
    ],
)  # fmt: skip
def test_out_of_range_values_name_their_field(field: str, value: object) -> None:
    with pytest.raises(RequestError) as err:
        SamplingParams(**{field: value}).validate(100)
    assert err.value.param == field


def test_the_defaults_are_off_and_llama_cpps() -> None:
    p = SamplingParams().validate(100)
    assert (p.typical_p, p.xtc_probability, p.xtc_threshold) == (1.0, 0.0, 0.1)
    assert (p.dry_multiplier, p.dry_base, p.dry_allowed_length, p.dry_penalty_last_n) == (
        0.0, 1.75, 2, -1,
    )  # fmt: skip
    assert p.dry_sequence_breakers == ["\n", ":", '"', "*"]
    assert not p.uses_dry and not p.uses_xtc
    SamplingParams(xtc_threshold=0.9, dry_penalty_last_n=0, dry_allowed_length=0).validate(100)


# ---- rows with and without them in one batch -------------------------------------------------


def _mixed_rows(vocab: int) -> list[tuple[dict, list[int]]]:
    """(sampling parameters, context) of rows with and without the llama.cpp samplers."""
    rng = random.Random(5)
    context = [rng.randrange(12) for _ in range(40)]
    return [
        (dict(), context),
        (dict(typical_p=0.7, seed=1), context),
        (dict(top_k=20, top_p=0.9, seed=2), context),
        (dict(xtc_probability=0.6, xtc_threshold=0.02, seed=3), context),
        (dict(min_p=0.05, repetition_penalty=1.2, seed=4), context),
        (dict(dry_multiplier=0.8, dry_allowed_length=1, seed=5), context),
        (dict(temperature=0.7, seed=6), context),
        (
            dict(
                typical_p=0.4,
                top_k=30,
                top_p=0.8,
                xtc_probability=1.0,
                seed=7,
                dry_multiplier=1.5,
                dry_allowed_length=0,
            ),
            context,
        ),  # fmt: skip
        (dict(temperature=0, dry_multiplier=2.0), context),
        (dict(temperature=0, typical_p=0.2, xtc_probability=1.0, xtc_threshold=0.0), context),
        (dict(presence_penalty=0.5, top_k=5, seed=8), context),
        (dict(xtc_probability=1.0, xtc_threshold=0.9, seed=9), context),
    ]


def _rows(spec: list[tuple[dict, list[int]]]) -> list[SampleRow]:
    rows = []
    for kw, context in spec:
        params = SamplingParams(**kw, dry_breakers=DryBreakers(frozenset({0})))
        rows.append(SampleRow(params, context[:30], context[30:], params.make_generator()))
    return rows


def test_each_row_of_a_mixed_batch_is_what_it_is_alone() -> None:
    spec = _mixed_rows(500)
    logits = _random_logits(len(spec), 500, 11)
    batch = _rows(spec)
    penalised = apply_penalties(logits, batch)
    sampled = [i for i, r in enumerate(batch) if not r.params.greedy]
    probs = draw_distribution(penalised[sampled], [batch[i] for i in sampled])
    alone_rows = _rows(spec)
    for j, i in enumerate(sampled):
        alone = apply_penalties(logits[i : i + 1], [alone_rows[i]])
        assert torch.equal(alone[0], penalised[i])
        assert torch.equal(draw_distribution(alone, [alone_rows[i]])[0], probs[j])
    # the rows without DRY have the logits of a batch without it (the input's, without penalties)
    no_dry = [i for i, (kw, _) in enumerate(spec) if "dry_multiplier" not in kw]
    assert torch.equal(apply_penalties(logits[no_dry], _rows([spec[i] for i in no_dry])),
                       penalised[no_dry])  # fmt: skip
    assert torch.equal(penalised[0], logits[0]) and torch.equal(penalised[6], logits[6])
    # and the rows without any of them draw from what they drew from in a batch of their own
    llama_cpp = {"typical_p", "xtc_probability", "dry_multiplier"}
    plain = [i for i in sampled if not spec[i][0].keys() & llama_cpp]
    before = _rows([spec[i] for i in plain])
    old = draw_distribution(apply_penalties(logits[plain], before), before)
    assert torch.equal(old, probs[[sampled.index(i) for i in plain]])


def test_a_mixed_batch_samples_each_seeded_row_as_alone() -> None:
    spec = _mixed_rows(500)
    logits = _random_logits(len(spec), 500, 12, scale=2.0)
    batch = _rows(spec)
    together = [sample(logits, batch).tokens for _ in range(20)]
    alone_rows = _rows(spec)
    seeded = [i for i, r in enumerate(batch) if r.generator is not None or r.params.greedy]
    for i in seeded:
        alone = [sample(logits[i : i + 1], [alone_rows[i]]).tokens[0] for _ in range(20)]
        assert alone == [t[i] for t in together], spec[i][0]
    # greedy rows: the argmax after DRY, untouched by typical_p and XTC
    greedy = [i for i, (kw, _) in enumerate(spec) if kw.get("temperature") == 0]
    for i in greedy:
        expected = int(apply_penalties(logits[i : i + 1], [batch[i]])[0].argmax())
        assert {t[i] for t in together} == {expected}


# ---- seeded output through the engine, alone and in a batch ----------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("ckpt") / "wide-gpt"
    save_checkpoint(GPT(ModelConfig(n_layer=1, n_head=8, n_embd=512, block_size=256)), path)
    return path


def test_seeded_output_with_them_is_batch_invariant(checkpoint) -> None:
    """As tests/engine/test_batch_invariance.py (with 15 others, for time), with
    `--batch-invariant`: the seeded request and most of the others use typical_p, XTC and DRY."""
    loaded = load_for_inference(checkpoint, device="cpu", dtype="float32", batch_invariant=True)
    engine = Engine(loaded.model, loaded.tokenizer, EngineConfig(max_num_seqs=16,
                                                                 batch_invariant=True))  # fmt: skip
    breakers = DryBreakerIndex(loaded.tokenizer).resolve(list(DRY_SEQUENCE_BREAKERS))
    prompt = loaded.tokenizer.encode("To be, or not to be, to be, or not to be, that is the")
    seeded = SamplingParams(
        temperature=0.8, max_tokens=40, ignore_eos=True, seed=1234, logprobs=3, typical_p=0.9,
        xtc_probability=0.5, xtc_threshold=0.0, dry_multiplier=0.8, dry_allowed_length=1,
        dry_breakers=breakers,
    )  # fmt: skip
    rng = random.Random(5)
    kinds = [
        dict(temperature=0),
        dict(temperature=1.0, typical_p=0.5),
        dict(temperature=0.7, top_p=0.9, seed=rng.randrange(1000), xtc_probability=0.3),
        dict(temperature=1.2, top_k=50, dry_multiplier=1.0, dry_breakers=breakers),
    ]
    others = [
        (
            [rng.randrange(50000) for _ in range(rng.randrange(3, 61))],
            SamplingParams(max_tokens=rng.randrange(10, 60), ignore_eos=True, **kinds[i % 4]),
        )
        for i in range(15)
    ]

    def generate(others) -> tuple[list[int], list[float]]:
        half = len(others) // 2
        for i, (ids, params) in enumerate(others[:half]):
            engine.add_request(f"before-{i}", ids, params)
        engine.add_request("seeded", prompt, seeded)
        for i, (ids, params) in enumerate(others[half:]):
            engine.add_request(f"after-{i}", ids, params)
        tokens, logprobs = [], []
        while engine.has_work():
            for ev in engine.step():
                assert ev.error is None
                if ev.request_id == "seeded":
                    tokens += ev.token_ids
                    logprobs += [lp.logprob for lp in ev.logprobs]
        return tokens, logprobs

    alone = generate([])
    together = generate(others)
    assert len(alone[0]) == 40 and len(set(alone[0])) > 10
    assert together == alone
