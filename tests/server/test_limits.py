"""Every protective limit: a flag with a documented default, enforced with an OpenAI-shaped 4xx.

One server runs with every limit set low; each case sends a request just over one limit (and,
where it makes sense, one just within it) and checks the status, `param`, that the flag's help
states that status and that docs/API.md documents the flag. The limits the CLI has are the flags
of its "request limits" group; each of them has a case here or a named test elsewhere.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
from gptserve.server.settings import LIMITS_GROUP, Settings, build_parser

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
    max_prompts=2,
    max_logprobs=2,
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
    ("max-prompts", body(prompt=["a", "b"]), body(prompt=["a", "b", "c"]), 400, "prompt", 0),
    ("max-logprobs", body(logprobs=2), body(logprobs=3), 400, "logprobs", 0),
]
# limit flags whose cases need a server of their own: flag -> "module::test" that checks it
COVERED_ELSEWHERE = {
    "max-queue": "test_api_overload::test_queue_full_then_recovers",
    "request-timeout": "test_faults::test_a_whole_request_past_the_timeout_answers_what_it_generated",
    "body-timeout": "test_faults::test_a_body_that_stops_arriving_gets_408_and_frees_its_slot",
}


def limit_flags() -> dict[str, str]:
    """The CLI's request-limit flags (without dashes) and their help texts."""
    group = next(g for g in build_parser()._action_groups if g.title == LIMITS_GROUP)
    return {a.option_strings[0][2:]: a.help for a in group._group_actions}


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
    flags = limit_flags()
    assert flag in flags, f"--{flag} is not a request-limit flag of the server"
    assert f"{status} " in flags[flag], f"--{flag}'s help does not say it answers {status}"
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


def test_every_limit_flag_is_covered_and_documented() -> None:
    flags = limit_flags()
    covered = {c[0] for c in CASES} | set(COVERED_ELSEWHERE)
    assert not set(flags) - covered, f"limit flags without a test: {set(flags) - covered}"
    assert not covered - set(flags), f"cases for flags the CLI lacks: {covered - set(flags)}"
    api = (REPO / "docs" / "API.md").read_text()
    for flag in flags:
        assert f"`--{flag}`" in api, f"--{flag} is not documented in docs/API.md"
    for flag, where in COVERED_ELSEWHERE.items():
        module_name, test_name = where.split("::")
        module = importlib.import_module(f"tests.server.{module_name}")
        assert callable(getattr(module, test_name, None)), f"{where} does not exist"
        source = (Path(module.__file__)).read_text()
        assert f"{flag.replace('-', '_')}=" in source, f"{module_name} never sets --{flag}"
