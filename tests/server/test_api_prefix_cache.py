"""Prefix caching over HTTP: usage.prompt_tokens_details.cached_tokens, /metrics, the off switch."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from gptserve.server.settings import Settings, settings_from_args

from tests.server.conftest import live_server

# 70 tokens of GPT-2 BPE: four full 16-token blocks, then 5 of the last 6 tokens from (a copy of)
# the block the last request left partly filled; one token is always left to compute
PROMPT = " ".join(f"w{i}" for i in range(35))


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    line = next(line for line in text.splitlines() if line.startswith(name + " "))
    return float(line.split()[1])


def complete(url: str, **extra) -> dict:
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, **extra}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("caching", [True, False], ids=["on", "off"])
def test_a_repeated_prompt_reports_its_cached_tokens_and_metrics_count_them(
    tiny_checkpoint: Path, caching: bool
):
    settings = Settings(model=str(tiny_checkpoint), max_num_seqs=4, no_prefix_cache=not caching)
    with live_server(settings) as live:
        first = complete(live.url)
        queries = metric(live.url, "gptserve_prefix_cache_queries_total")
        second = complete(live.url)
        assert first["usage"]["prompt_tokens"] == 70
        assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        expected = 69 if caching else 0
        assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": expected}
        assert second["choices"][0]["text"] == first["choices"][0]["text"]
        assert metric(live.url, "gptserve_prefix_cache_hits_total") == expected
        assert metric(live.url, "gptserve_prefix_cache_queries_total") == queries + (
            70 if caching else 0
        )
        # n = 2 shares the prompt: counted once per prompt; a stream's usage chunk says it too
        body = {"n": 2, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream(
            "POST", f"{live.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, **body}
        ) as r:
            lines = [line for line in r.iter_lines() if line.startswith("data: {")]
        assert f'"prompt_tokens_details":{{"cached_tokens":{expected}}}' in lines[-1].replace(
            " ", ""
        )
        assert live.engine.kv_usage == 0  # nothing holds a block; cached blocks count as free


def test_the_switch_parses():
    assert settings_from_args(["--no-prefix-cache"]).no_prefix_cache is True
    assert settings_from_args([]).no_prefix_cache is False
