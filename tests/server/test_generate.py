"""The offline generate command streams through the engine and fails with one-line errors."""

import subprocess
import sys

import pytest
import torch

from model import GPT, ModelConfig, save_checkpoint


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny")
    save_checkpoint(GPT(ModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=64)), path)
    return path


def _run(*args):
    return subprocess.run(
        [sys.executable, "-m", "server.generate", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_generates_the_same_text_for_the_same_seed(tiny_dir):
    first = _run("--model", str(tiny_dir), "To be", "--max-tokens", "12", "--seed", "3", "--echo")
    second = _run("--model", str(tiny_dir), "To be", "--max-tokens", "12", "--seed", "3", "--echo")
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("To be") and len(first.stdout) > len("To be\n")
    assert first.stdout == second.stdout


def test_n_completions(tiny_dir):
    out = _run("--model", str(tiny_dir), "x", "--n", "2", "--max-tokens", "4", "--seed", "1")
    assert out.returncode == 0, out.stderr
    assert "--- completion 0 ---" in out.stdout and "--- completion 1 ---" in out.stdout


@pytest.mark.parametrize(
    "args,message",
    [
        (["--model", "/nonexistent/dir", "x"], "does not exist"),
        (["--temperature", "-1", "x"], "temperature"),
        (["--max-tokens", "100", "x"], "maximum context length"),
    ],
)
def test_errors_are_one_line(tiny_dir, args, message):
    if "--model" not in args:
        args = ["--model", str(tiny_dir), *args]
    out = _run(*args)
    assert out.returncode == 2
    assert message in out.stderr and out.stderr.count("\n") == 1
    assert "Traceback" not in out.stderr
