"""The failure model: what one sequence breaks ends its own request, and the step goes on.

A grammar whose engine gives up, a constraint that refuses the sampled token, a detokenizer that
raises, a sampler row that raises: each ends only the request it belongs to, with an error event
whose code says it was that request's (engine.sequence), and counts as no failed step.
"""

import torch
from gptserve.engine import sampler as sampler_module
from gptserve.engine.engine import Engine, EngineConfig
from gptserve.engine.grammar import ConstraintViolation, compile_constraint
from gptserve.engine.sampler import SamplingParams
from gptserve.engine.sequence import GRAMMAR_ERROR, SEQUENCE_ERROR

from tests.engine.test_engine import run


def greedy(max_tokens: int = 12, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def baseline(model, tok, prompt: str) -> list[int]:
    engine = Engine(model, tok, EngineConfig(kv_block_size=8, num_blocks=64))
    engine.add_request("alone", tok.encode(prompt), greedy())
    return [t for ev in run(engine)[("alone", 0)] for t in ev.token_ids]


class _BreaksAfter:
    """A constraint that lets everything through and gives up after `after` tokens, as the
    grammar engine does when a budget runs out."""

    def __init__(self, after: int) -> None:
        self.after, self.seen = after, 0
        self.error: str | None = None

    def fork(self) -> "_BreaksAfter":
        return _BreaksAfter(self.after)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int = 0) -> None:
        bitmask[row] = -1
        if self.seen >= self.after:
            self.error = "too costly to constrain (lexer error: too many states)"

    def advance(self, token: int) -> None:
        self.seen += 1

    def is_finished(self) -> bool:
        return False


def _engine_with_neighbour(model, tok, params: SamplingParams) -> tuple[Engine, dict]:
    engine = Engine(model, tok, EngineConfig(kv_block_size=8, num_blocks=64))
    engine.add_request("bad", tok.encode("Once upon"), params)
    engine.add_request("good", tok.encode("To be, or not"), greedy())
    return engine, run(engine)


def _assert_only_bad_failed(engine, out, expected_good, code) -> None:
    bad = out[("bad", 0)]
    assert bad[-1].error and bad[-1].error_code == code
    good = out[("good", 0)]
    assert [t for ev in good for t in ev.token_ids] == expected_good
    assert good[-1].finish_reason == "length" and not any(ev.error for ev in good)
    assert engine.num_failed_steps == 0
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_a_grammar_that_gives_up_ends_its_request_alone(model, tok):
    expected = baseline(model, tok, "To be, or not")
    engine, out = _engine_with_neighbour(model, tok, greedy(constraint=_BreaksAfter(3)))
    _assert_only_bad_failed(engine, out, expected, GRAMMAR_ERROR)
    assert "too costly" in out[("bad", 0)][-1].error
    assert sum(len(ev.token_ids) for ev in out[("bad", 0)]) == 3  # no EOS-only empty ending


def test_a_refused_token_ends_its_request_alone(model, tok, monkeypatch):
    expected = baseline(model, tok, "To be, or not")
    constraint = compile_constraint("regex", "[a-z ]+", tok)

    def refuse(self, token):
        raise ConstraintViolation(f"token {token} is not allowed here")

    monkeypatch.setattr(type(constraint), "advance", refuse)
    engine, out = _engine_with_neighbour(model, tok, greedy(constraint=constraint))
    _assert_only_bad_failed(engine, out, expected, GRAMMAR_ERROR)


def test_a_detokenizer_fault_ends_its_request_alone(model, tok, monkeypatch):
    expected = baseline(model, tok, "To be, or not")
    engine = Engine(model, tok, EngineConfig(kv_block_size=8, num_blocks=64))
    engine.add_request("bad", tok.encode("Once upon"), greedy(n=2))
    engine.add_request("good", tok.encode("To be, or not"), greedy())
    bad = engine._requests["bad"].seqs[0]

    def broken(token: int) -> str:
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")

    monkeypatch.setattr(bad._detok, "add", broken)
    out = run(engine)
    for index in (0, 1):  # both completions of the failed request end with its error
        assert out[("bad", index)][-1].error_code == SEQUENCE_ERROR
    _assert_only_bad_failed(engine, out, expected, SEQUENCE_ERROR)


def test_a_sampler_row_fault_ends_its_request_alone(model, tok, monkeypatch):
    expected = baseline(model, tok, "To be, or not")
    real = sampler_module.sample

    def fails_on_bias(logits, rows, allowed=None):
        if any(row.params.logit_bias for row in rows):
            raise RuntimeError("a row the sampler cannot draw")
        return real(logits, rows, allowed)

    monkeypatch.setattr("gptserve.engine.engine.sample", fails_on_bias)
    engine, out = _engine_with_neighbour(model, tok, greedy(logit_bias={5: 1.0}))
    _assert_only_bad_failed(engine, out, expected, SEQUENCE_ERROR)
    assert "sampling failed" in out[("bad", 0)][-1].error
