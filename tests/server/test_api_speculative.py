"""Speculative decoding over HTTP: the same greedy text, and the acceptance counters in /metrics."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from gptserve.server.settings import Settings, SettingsError

from tests.server.conftest import live_server

PROMPT = "one two three four five six seven eight " * 4  # text that repeats: lookups find it


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    line = next(line for line in text.splitlines() if line.startswith(name + " "))
    return float(line.split()[1])


def greedy_text(url: str) -> str:
    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_ngram_and_draft_speculation_give_the_plain_greedy_text(tiny_checkpoint: Path):
    with live_server(Settings(model=str(tiny_checkpoint))) as live:
        plain = greedy_text(live.url)
        assert metric(live.url, "gptserve_spec_decode_draft_tokens_total") == 0
    for extra in ({"speculative": "ngram"}, {"draft_model": str(tiny_checkpoint)}):
        with live_server(Settings(model=str(tiny_checkpoint), **extra)) as live:
            assert greedy_text(live.url) == plain
            proposed = metric(live.url, "gptserve_spec_decode_draft_tokens_total")
            accepted = metric(live.url, "gptserve_spec_decode_accepted_tokens_total")
            assert proposed > 0 and 0 < accepted <= proposed
            if "draft_model" in extra:  # the model as its own draft: every guess is right
                assert accepted == proposed


def test_speculation_flags_are_checked(tiny_checkpoint: Path, tmp_path: Path):
    with pytest.raises(SettingsError, match="exclude each other"):
        Settings(speculative="ngram", draft_model=str(tiny_checkpoint)).validate()
    with pytest.raises(SettingsError, match="no checkpoint directory"):
        Settings(draft_model=str(tmp_path / "missing")).validate()
    with pytest.raises(SettingsError, match="--num-speculative-tokens"):
        Settings(num_speculative_tokens=0).validate()


def test_batch_invariance_excludes_speculation(tiny_checkpoint: Path):
    with pytest.raises(SettingsError, match="--batch-invariant cannot hold"):
        Settings(batch_invariant=True, speculative="ngram").validate()
    with pytest.raises(SettingsError, match="--batch-invariant cannot hold"):
        Settings(batch_invariant=True, draft_model=str(tiny_checkpoint)).validate()
    Settings(batch_invariant=True).validate()
