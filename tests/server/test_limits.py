"""Every protective limit: a flag with a documented default, enforced with an OpenAI-shaped 4xx.

One server runs with every limit set low; each case sends a request just over one limit (and,
where it makes sense, one just within it) and checks the status, `param` and that docs/API.md
documents the flag.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from server.settings import Settings, build_parser
from tests.server.conftest import MODEL_NAME, LiveServer, live_server, slow_steps

REPO = Path(__file__).resolve().parents[2]
LIMITS = dict(
    max_prompt_tokens=20,
    max_tokens_limit=10,
    max_n=2,
    max_stop=2,
    max_stop_length=5,
    max_logit_bias=3,
    max_body_bytes=2000,
    max_concurrent_requests=2,
)


@pytest.fixture(scope="module")
def limited(tiny_checkpoint: Path) -> Iterator[LiveServer]:
    with live_server(Settings(model=str(tiny_checkpoint), **LIMITS)) as live:
        slow_steps(live)  # requests held open for the concurrency case stay open
        yield live


def body(**fields: object) -> dict:
    return {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2, **fields}


HOLD = body(max_tokens=10, ignore_eos=True, stream=True)

# (flag, body within the limit, body over it, status over it, param over it, requests held open)
CASES = [
    ("max-prompt-tokens", body(prompt=[1] * 20), body(prompt=[1] * 21), 400, "prompt", 0),
    ("max-tokens-limit", body(max_tokens=10), body(max_tokens=11), 400, "max_tokens", 0),
    ("max-n", body(n=2), body(n=3), 400, "n", 0),
    ("max-stop", body(stop=["a", "b"]), body(stop=["a", "b", "c"]), 400, "stop", 0),
    ("max-stop-length", body(stop="abcde"), body(stop="abcdef"), 400, "stop", 0),
    (
        "max-logit-bias",
        body(logit_bias={str(i): 1 for i in range(3)}),
        body(logit_bias={str(i): 1 for i in range(4)}),
        400,
        "logit_bias",
        0,
    ),
    ("max-body-bytes", body(user="x" * 1800), body(user="x" * 2000), 413, None, 0),
    ("max-concurrent-requests", body(), body(), 429, None, 2),
]


@pytest.mark.parametrize(
    ("flag", "within", "over", "status", "param", "hold"), CASES, ids=[c[0] for c in CASES]
)
def test_limit(
    limited: LiveServer,
    flag: str,
    within: dict,
    over: dict,
    status: int,
    param: str | None,
    hold: int,
) -> None:
    url = f"{limited.url}/v1/completions"
    options = {a.dest: a for a in build_parser()._actions}
    assert flag.replace("-", "_") in options, f"--{flag} is not a server flag"
    assert f"`--{flag}`" in (REPO / "docs" / "API.md").read_text(), f"--{flag} is not documented"
    if not hold:
        r = httpx.post(url, json=within, timeout=30)
        assert r.status_code == 200, r.text
    with ExitStack() as stack:
        for _ in range(hold):
            held = stack.enter_context(httpx.stream("POST", url, json=HOLD, timeout=30))
            assert held.status_code == 200
        r = httpx.post(url, json=over, timeout=30)
        if hold:  # probes are never counted against the cap
            assert httpx.get(f"{limited.url}/health", timeout=10).status_code == 200
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param
    assert str(LIMITS[flag.replace("-", "_")]) in err["message"], err["message"]
    if status == 429:
        assert r.headers["retry-after"] == "1" and err["type"] == "rate_limit_error"
    else:
        assert err["type"] == "invalid_request_error"
    if hold:  # the slots come back once the held requests end
        r = httpx.post(url, json=within, timeout=30)
        assert r.status_code == 200, r.text
    assert limited.wait_blocks_free()


def test_every_limit_flag_is_covered() -> None:
    flags = {c[0] for c in CASES}
    limit_flags = {a.option_strings[0][2:] for a in build_parser()._actions if a.option_strings}
    assert flags <= limit_flags
    assert {"max-prompts", "max-logprobs"} <= limit_flags  # covered by test_api_errors
