"""The offline generate command streams through the engine and fails with one-line errors."""

import subprocess
import sys

import pytest
import torch
from gptserve.engine.engine import Engine, EngineConfig
from gptserve.engine.sampler import SamplingParams
from gptserve.model import GPT, ModelConfig, get_tokenizer, load_checkpoint, save_checkpoint


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny")
    save_checkpoint(GPT(ModelConfig(n_layer=1, n_head=2, n_embd=32, block_size=64)), path)
    return path


def _run(*args):
    return subprocess.run(
        [sys.executable, "-m", "gptserve.engine.cli", *args],
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


def test_greedy_output_is_the_engines(tiny_dir):
    out = _run("--model", str(tiny_dir), "To be", "--max-tokens", "12", "--temperature", "0")
    assert out.returncode == 0, out.stderr
    tok = get_tokenizer()
    engine = Engine(load_checkpoint(tiny_dir), tok)
    engine.add_request("g", tok.encode("To be"), SamplingParams(temperature=0, max_tokens=12))
    text = ""
    while engine.has_work():
        text += "".join(e.text for e in engine.step())
    assert text and out.stdout == text + "\n"


def test_a_float16_kv_cache_gives_the_engines_greedy_text_over_that_cache(tiny_dir):
    out = _run("--model", str(tiny_dir), "To be", "--max-tokens", "12", "--temperature", "0",
               "--kv-cache-dtype", "float16")  # fmt: skip
    assert out.returncode == 0, out.stderr
    tok = get_tokenizer()
    engine = Engine(load_checkpoint(tiny_dir), tok, EngineConfig(kv_cache_dtype=torch.float16))
    assert engine.pools.k.dtype == torch.float16
    engine.add_request("g", tok.encode("To be"), SamplingParams(temperature=0, max_tokens=12))
    text = ""
    while engine.has_work():
        text += "".join(e.text for e in engine.step())
    assert text and out.stdout == text + "\n"
    bad = _run("--model", str(tiny_dir), "x", "--kv-cache-dtype", "int4")
    assert bad.returncode == 2 and "invalid choice: 'int4'" in bad.stderr.strip().splitlines()[-1]
    wider = _run(
        "--model", str(tiny_dir), "x", "--dtype", "bfloat16", "--kv-cache-dtype", "float32"
    )
    assert wider.returncode == 2 and wider.stderr.strip().count("\n") == 0, wider.stderr
    assert wider.stderr.startswith("error: --kv-cache-dtype float32 does not go with a bfloat16")


def test_n_completions(tiny_dir):
    out = _run("--model", str(tiny_dir), "x", "--n", "2", "--max-tokens", "4", "--seed", "1")
    assert out.returncode == 0, out.stderr
    head, rest = out.stdout.split("--- completion 0 ---\n")
    first, second = rest.split("--- completion 1 ---\n")
    assert head == "" and first.strip() and second.strip()
    assert first != second  # each completion draws from its own seeded generator


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


def test_a_tiny_temperature_is_greedy_as_over_http(tiny_dir):
    """engine.limits snaps a temperature too small to divide by to 0, offline too."""
    tiny = _run("--model", str(tiny_dir), "To be", "--max-tokens", "12", "--temperature", "1e-300")
    greedy = _run("--model", str(tiny_dir), "To be", "--max-tokens", "12", "--temperature", "0")
    assert tiny.returncode == 0, tiny.stderr
    assert tiny.stdout == greedy.stdout


@pytest.fixture(scope="module")
def adapter_dirs(tiny_dir, tmp_path_factory):
    """A PEFT adapter for the tiny model (in a directory named "poet") and one for a wider
    model."""
    from gptserve.model.lora.peft_format import write_peft

    from tests.lora_testing import random_adapter

    root = tmp_path_factory.mktemp("adapters")
    config = load_checkpoint(tiny_dir).config
    write_peft(random_adapter(config, "poet", std=0.5), root / "poet", config, str(tiny_dir))
    other = ModelConfig(n_layer=1, n_head=2, n_embd=64, block_size=64)
    write_peft(random_adapter(other, "wide"), root / "wide", other, "another")
    return root


def test_an_adapter_gives_its_merged_models_greedy_text(tiny_dir, adapter_dirs):
    from gptserve.model.lora.peft_format import read_peft

    from tests.lora_testing import merged

    args = ["--model", str(tiny_dir), "To be", "--max-tokens", "12", "--temperature", "0"]
    out = _run(*args, "--lora", str(adapter_dirs / "poet"))
    assert out.returncode == 0, out.stderr
    base = load_checkpoint(tiny_dir)
    tok = get_tokenizer()
    engine = Engine(merged(base, read_peft(adapter_dirs / "poet", base.config)), tok)
    engine.add_request("g", tok.encode("To be"), SamplingParams(temperature=0, max_tokens=12))
    text = ""
    while engine.has_work():
        text += "".join(e.text for e in engine.step())
    assert text and out.stdout == text + "\n"
    assert out.stdout != _run(*args).stdout  # the adapter changes the text


@pytest.mark.parametrize(
    "adapter, message",
    [("missing", "no adapter directory"), ("wide", "do not fit the base model's")],
)
def test_an_adapter_that_cannot_be_used_is_one_line(tiny_dir, adapter_dirs, adapter, message):
    out = _run("--model", str(tiny_dir), "x", "--lora", str(adapter_dirs / adapter))
    assert out.returncode == 2
    assert message in out.stderr and out.stderr.count("\n") == 1
    assert "Traceback" not in out.stderr


def test_a_reader_that_goes_away_stops_it_quietly(tiny_dir):
    """`gptserve generate ... | head -1`: no traceback when the pipe closes."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "gptserve.engine.cli", "--model", str(tiny_dir), "To be", "--max-tokens",
         "60", "--seed", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    proc.stdout.read(1)
    proc.stdout.close()  # the reader goes away while it still writes
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "Traceback" not in err
