"""Sequence: what text each token releases, where stop strings end a completion, and min_tokens."""

from __future__ import annotations

import pytest
from gptserve.engine.sampler import SamplingParams
from gptserve.engine.sequence import Sequence
from gptserve.model import get_tokenizer

TOK = get_tokenizer()
EOS = TOK.eot_token
MAX_LEN = 1024


def one_token(text: str) -> int:
    ids = TOK.encode(text)
    assert len(ids) == 1, f"{text!r} is {len(ids)} tokens"
    return ids[0]


def run(pieces: list[str], **params: object) -> tuple[Sequence, list[str]]:
    """Append the tokens of `pieces` (one token each) until the sequence finishes."""
    seq = Sequence(0, "r", 0, [EOS], SamplingParams(**params), TOK)
    released = []
    for piece in pieces:
        released.append(seq.append(one_token(piece), EOS, MAX_LEN))
        if seq.finished:
            break
    return seq, released


def test_a_stop_string_ends_the_completion_and_is_not_released() -> None:
    seq, released = run(["Hello", " world", ".", " More"], stop=[" world"], max_tokens=10)
    assert seq.finish_reason == "stop" and seq.num_generated == 2
    assert "".join(released) == "Hello" == seq.text


def test_the_stop_string_that_ended_it_is_its_stop_reason() -> None:
    # the one that begins first, whichever is listed first; the first listed at a tie
    seq, _ = run(["Hello", " world", "."], stop=["d.", " wor", "Hello wo"], max_tokens=10)
    assert seq.finish_reason == "stop" and seq.stop_reason == "Hello wo" and seq.text == ""
    seq, _ = run(["a", "b", "c"], stop=["bc", "b"], max_tokens=10)
    assert seq.stop_reason == "b" and seq.text == "a"
    seq, _ = run(["a", "b", "c"], stop_token_ids=[one_token("b")], max_tokens=10)
    assert seq.finish_reason == "stop" and seq.stop_reason is None  # no string: no reason
    seq, _ = run(["a", "b", "c"], stop=["z"], max_tokens=2)
    assert seq.finish_reason == "length" and seq.stop_reason is None


def test_text_that_may_begin_a_stop_string_is_held_back_then_released() -> None:
    seq, released = run(["Hello", " wor", "m", "!"], stop=[" world"], max_tokens=4)
    assert released == ["Hello", "", " worm", "!"]
    assert seq.finish_reason == "length" and seq.text == "Hello worm!"


@pytest.mark.parametrize("min_tokens", [0, 1, 2])
def test_a_stop_string_counts_once_min_tokens_are_reached(min_tokens: int) -> None:
    seq, released = run(["a", "b", "c"], stop=["b"], min_tokens=min_tokens, max_tokens=10)
    assert seq.finish_reason == "stop" and seq.num_generated == 2
    assert "".join(released) == "a"


def test_a_stop_string_before_min_tokens_is_kept_as_text() -> None:
    pieces = ["a", "b", "a", "c", "b", "d"]
    seq, released = run(pieces, stop=["b"], min_tokens=3, max_tokens=10)
    # the "b" of token 2 is text; the first "b" to end at or after token 3 stops it
    assert seq.finish_reason == "stop" and seq.num_generated == 5
    assert "".join(released) == "abac" == seq.text


def test_a_stop_string_may_end_in_the_min_tokens_th_token() -> None:
    seq, released = run(["x", "a", "b", "c"], stop=["ab"], min_tokens=3, max_tokens=10)
    assert seq.finish_reason == "stop" and seq.num_generated == 3
    assert "".join(released) == "x"


def test_a_whole_stop_string_before_min_tokens_never_stops_it_later() -> None:
    seq, released = run(["a", "b", "c", "d"], stop=["ab"], min_tokens=3, max_tokens=4)
    assert seq.finish_reason == "length" and seq.num_generated == 4
    assert "".join(released) == "abcd" == seq.text


@pytest.mark.parametrize("min_tokens", [0, 2, 5])
def test_stop_token_ids_end_without_text(min_tokens: int) -> None:
    # the sampler bans stop tokens before min_tokens; a stop token that does come still ends it
    seq, released = run(["a", "b", "c"], stop_token_ids=[one_token("b")], min_tokens=min_tokens,
                        max_tokens=10)  # fmt: skip
    assert seq.finish_reason == "stop" and "".join(released) == "a"


def test_text_offsets_say_where_each_token_begins() -> None:
    pieces = ["Hello", " wor", "m", "!"]
    seq, _ = run(pieces, max_tokens=4)
    assert seq.text_offsets == [0, 5, 9, 10]
    assert [seq.text[o : o + len(p)] for o, p in zip(seq.text_offsets, pieces)] == pieces


def test_a_character_split_over_tokens_is_released_whole() -> None:
    ids = TOK.encode("日本")  # multi-byte characters; some tokens hold part of a character
    seq = Sequence(0, "r", 0, [EOS], SamplingParams(max_tokens=len(ids)), TOK)
    released = [seq.append(t, EOS, MAX_LEN) for t in ids]
    assert "".join(released) == "日本"
    assert all(r in ("", "日", "本", "日本") for r in released)
