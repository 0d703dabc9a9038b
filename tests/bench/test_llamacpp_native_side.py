"""bench/llamacpp.py's llama.cpp side by the native tools: which tool each row runs with which
flags, its rate as the tool reports it, and its CPU time as the difference of two runs (fake
tools that burn a known CPU time a repetition stand in for llama.cpp's)."""

import json
import sys
from pathlib import Path

import pytest

from bench.llamacpp import REPS, native_side
from bench.llamacpp_native import NativeBuild

BURN = 0.05  # CPU seconds a fake repetition burns

FAKE = """#!{python}
import json, sys, time
args = sys.argv[1:]
with open({log!r}, "a") as log:
    log.write(json.dumps([{name!r}, args]) + "\\n")
reps = int(args[args.index("-r") + 1]) if "-r" in args else 1
end = time.process_time() + {burn} * reps
while time.process_time() < end:
    pass
{output}
"""


def _tool(folder: Path, name: str, output: str) -> None:
    path = folder / name
    path.write_text(FAKE.format(python=sys.executable, log=str(folder / "calls.jsonl"),
                                name=name, burn=BURN, output=output))  # fmt: skip
    path.chmod(0o755)


@pytest.fixture
def build(tmp_path: Path) -> NativeBuild:
    _tool(tmp_path, "llama-bench", 'print(json.dumps([{"avg_ts": 100.0}]))')
    _tool(tmp_path, "llama-batched-bench", 'print(json.dumps({"t": 2.0}))')
    return NativeBuild(tmp_path)


def _calls(build: NativeBuild) -> list[tuple[str, list[str]]]:
    lines = (build.bin_dir / "calls.jsonl").read_text().splitlines()
    return [tuple(json.loads(line)) for line in lines]


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_decode_x1_is_tg_at_the_prompts_depth_with_the_cpu_of_the_extra_repetitions(build):
    run = native_side(build, Path("model.gguf"), threads=2)
    got = run("decode x1", [[7] * 64], 128)
    assert got.rate == 100.0 and got.build == "llama-bench"
    calls = _calls(build)
    assert [_flag(a, "-r") for _, a in calls] == [str(REPS), "1"]
    for name, args in calls:
        assert name == "llama-bench"
        assert (_flag(args, "-p"), _flag(args, "-n"), _flag(args, "-d")) == ("0", "128", "64")
        assert (_flag(args, "-t"), _flag(args, "-m")) == ("2", "model.gguf")
    # one repetition's CPU is BURN (start-up cancels): 128 tokens / 0.05 s, loosely
    assert 128 / (2.5 * BURN) < got.cpu_rate < 128 / (0.5 * BURN)


def test_prompt_rows_are_pp_and_streams_are_the_batched_tool(build):
    run = native_side(build, Path("model.gguf"), threads=1)
    assert run("warm-up", [[1] * 64], 4) is None  # the tools warm up themselves
    pp = run("prompt 512", [[1] * 512], 1)
    assert pp.rate == 100.0 and pp.build == "llama-bench"
    assert all((_flag(a, "-p"), _flag(a, "-n")) == ("512", "0") for _, a in _calls(build))
    streams = run("decode 32 streams", [[1] * 64] * 32, 128)
    assert streams.build == "llama-batched-bench"
    assert streams.rate == 32 * 128 / 2.0  # the tool's whole time, prefill included
    name, args = _calls(build)[-1]
    assert name == "llama-batched-bench"
    assert (_flag(args, "-npp"), _flag(args, "-ntg"), _flag(args, "-npl")) == ("64", "128", "32")
