"""train.py end to end on tiny models: loss falls, kill-and-resume, checkpoints, DDP, errors.

In-process runs call train.main(argv); runs that must be separate processes (SIGKILL, torchrun)
use subprocesses. Tiny models (2 layers, width 64, block 32) on a slice of Shakespeare.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import gptserve.training.data as training_data
import numpy as np
import pytest
import torch
from gptserve.model import GPT, ModelConfig, get_tokenizer, load_checkpoint, save_checkpoint
from gptserve.training import cli as train
from gptserve.training.args import parse_config
from gptserve.training.checkpointing import BEST_DIR, STATE_FILE
from gptserve.training.data import find_text_files, tokenize_cached
from gptserve.training.step import LossModule, lr_at, make_optimizer
from safetensors.torch import load_file

from tests.train import ddp_worker

REPO = Path(__file__).resolve().parents[2]
TINY = [
    "--n-layer",
    "2",
    "--n-head",
    "2",
    "--n-embd",
    "64",
    "--block-size",
    "32",
    "--batch-size",
    "8",
    "--lr",
    "3e-3",
    "--warmup-steps",
    "5",
    "--eval-iters",
    "4",
    "--sample-tokens",
    "8",
]


@pytest.fixture(scope="module")
def data_slice(shakespeare_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The first 300 kB of Shakespeare (~94k tokens)."""
    path = tmp_path_factory.mktemp("data") / "shakespeare_slice.txt"
    with open(shakespeare_path, encoding="utf-8") as f:
        path.write_text(f.read(300_000), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("token-cache")


def read_metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def run_main(argv: list[str], capsys: pytest.CaptureFixture | None = None) -> int:
    code = train.main(argv)
    if capsys is not None:
        capsys.readouterr()
    return code


@pytest.fixture(scope="module")
def trained(data_slice: Path, cache_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("run")
    code = train.main(
        [
            "--data",
            str(data_slice),
            "--out",
            str(out),
            "--cache-dir",
            str(cache_dir),
            *TINY,
            "--max-steps",
            "40",
            "--eval-interval",
            "20",
            "--log-interval",
            "5",
            "--save-dtype",
            "bfloat16",
        ]
    )
    assert code == 0
    return out


def test_loss_falls_on_shakespeare(trained: Path) -> None:
    rows = read_metrics(trained)
    assert [r["step"] for r in rows] == list(range(5, 41, 5))
    assert all(r["lr"] > 0 and r["tokens_per_s"] > 0 for r in rows)
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    assert len(val) == 2  # steps 20, 40
    assert rows[0]["train_loss"] > 9.0  # ~ln(50257) = 10.8 at the start
    assert rows[-1]["train_loss"] < rows[0]["train_loss"] - 2.5
    assert val[-1] < val[0]
    assert (trained / "loss.png").stat().st_size > 0


def test_output_loads_generates_and_matches_training_state(trained: Path) -> None:
    state = torch.load(trained / STATE_FILE, weights_only=True)
    assert state["step"] == 40
    served = load_file(str(trained / "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in served.values())  # --save-dtype bfloat16
    assert state["model"]["transformer.wte.weight"].dtype == torch.float32  # resume keeps fp32
    torch.testing.assert_close(
        served["transformer.wte.weight"].float(),
        state["model"]["transformer.wte.weight"],
        rtol=1e-2,
        atol=1e-3,
    )
    tok = get_tokenizer("gpt2")
    for path in (trained, trained / BEST_DIR):
        model = load_checkpoint(path, dtype=torch.float32)
        idx = torch.tensor([tok.encode("ROMEO:")])
        for _ in range(5):  # greedy
            idx = torch.cat([idx, model(idx)[:, -1:].argmax(-1)], dim=1)
        assert idx.shape == (1, len(tok.encode("ROMEO:")) + 5)
        assert isinstance(tok.decode(idx[0].tolist()), str)


def _popen(argv: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(REPO / "train.py"), *argv],
        cwd=REPO,
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
    )


def test_sigkill_then_resume_gives_the_same_loss_curve(
    data_slice: Path, cache_dir: Path, tmp_path: Path
) -> None:
    args = [
        "--data",
        str(data_slice),
        "--cache-dir",
        str(cache_dir),
        *TINY,
        "--dropout",
        "0.1",
        "--max-steps",
        "30",
        "--eval-interval",
        "10",
        "--log-interval",
        "1",
        "--sample-tokens",
        "0",
        "--threads",
        "1",
    ]
    full, killed = tmp_path / "full", tmp_path / "killed"
    ref = _popen([*args, "--out", str(full)], tmp_path / "full.log")
    victim = _popen([*args, "--out", str(killed)], tmp_path / "killed.log")
    deadline = time.monotonic() + 120
    while not (killed / STATE_FILE).exists():
        assert victim.poll() is None and time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.02)
    os.kill(victim.pid, signal.SIGKILL)
    assert victim.wait() == -signal.SIGKILL
    killed_at = torch.load(killed / STATE_FILE, weights_only=True)["step"]
    assert killed_at < 30
    resumed = subprocess.run(
        [sys.executable, str(REPO / "train.py"), "--out", str(killed), "--resume"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert ref.wait() == 0
    a, b = read_metrics(full), read_metrics(killed)
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, 31))
    for ra, rb in zip(a, b):  # bit for bit, as docs/TRAINING.md says
        assert {k: v for k, v in ra.items() if k != "tokens_per_s"} == {
            k: v for k, v in rb.items() if k != "tokens_per_s"
        }
    sa = load_file(str(full / "model.safetensors"))
    sb = load_file(str(killed / "model.safetensors"))
    assert sa.keys() == sb.keys() and all(torch.equal(sa[key], sb[key]) for key in sa)


@pytest.mark.parametrize(
    "variant",
    [["--pos-encoding", "sinusoidal"], ["--activation", "relu"], ["--norm-position", "post"]],
    ids=["sinusoidal", "relu", "post-ln"],
)
def test_seed_variants_train(
    variant: list[str],
    data_slice: Path,
    cache_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
) -> None:
    code = run_main(
        [
            "--data",
            str(data_slice),
            "--out",
            str(tmp_path),
            "--cache-dir",
            str(cache_dir),
            *TINY,
            *variant,
            "--max-steps",
            "20",
            "--eval-interval",
            "20",
            "--log-interval",
            "1",
            "--sample-tokens",
            "0",
        ],
        capsys,
    )
    assert code == 0
    losses = [r["train_loss"] for r in read_metrics(tmp_path)]
    assert np.mean(losses[-5:]) < losses[0] - 1.5
    config = json.loads((tmp_path / "config.json").read_text())
    key, value = variant[0][2:].replace("-", "_"), variant[1]
    assert config[key] == value
    load_checkpoint(tmp_path)


def test_two_process_ddp_matches_one_process_on_the_global_batch(tmp_path: Path) -> None:
    out = tmp_path / "ddp.pt"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(Path(ddp_worker.__file__)),
            str(out),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = torch.load(out, weights_only=True)
    model = ddp_worker.fresh_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    single = ddp_worker.run(LossModule(model), model, rank=0, world=1)
    assert result["losses"] == pytest.approx(single["losses"], rel=1e-5)
    assert result["norms"] == pytest.approx(single["norms"], rel=1e-5)
    for key, grad in single["grads"].items():
        torch.testing.assert_close(result["grads"][key], grad, rtol=1e-4, atol=1e-7)
    # The all-reduce sums in another order; AdamW turns tiny gradients into lr-sized steps, so
    # weights agree to ~1e-5 while one update moves them by ~lr = 1e-2.
    changed = 0
    for key, value in model.state_dict().items():
        torch.testing.assert_close(result["state"][key], value, rtol=1e-4, atol=2e-5)
        changed += not torch.equal(value, before[key])
    assert changed > 10  # the update did move the weights


def test_torchrun_end_to_end_rank0_writes(
    data_slice: Path, cache_dir: Path, tmp_path: Path
) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(REPO / "train.py"),
            "--data",
            str(data_slice),
            "--out",
            str(tmp_path),
            "--cache-dir",
            str(cache_dir),
            *TINY,
            "--max-steps",
            "4",
            "--eval-interval",
            "2",
            "--log-interval",
            "1",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4]  # one writer
    state = torch.load(tmp_path / STATE_FILE, weights_only=True)
    assert len(state["ranks"]) == 2 and state["step"] == 4
    assert state["ranks"][0]["sampler"] != state["ranks"][1]["sampler"]  # own batches per rank
    load_checkpoint(tmp_path)


def test_tokenize_cache_is_reused_and_keyed_on_content(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "a.txt").write_text("Hello there.\nGeneral Kenobi!\n")
    (folder / "b.txt").write_text("Second document.\n")
    (folder / "skip.md").write_text("not text data")
    files = find_text_files(folder)
    assert [f.name for f in files] == ["a.txt", "b.txt"]
    path = tokenize_cached(files, tmp_path / "cache", progress=False)
    tok = get_tokenizer("gpt2")
    expected = (
        tok.encode("Hello there.\nGeneral Kenobi!\n")
        + [tok.eot_token]
        + tok.encode("Second document.\n")
    )
    assert np.fromfile(path, dtype=np.uint16).tolist() == expected

    def boom(name: str) -> None:
        raise AssertionError("re-tokenized unchanged data")

    monkeypatch.setattr(training_data, "get_tokenizer", boom)
    assert tokenize_cached(files, tmp_path / "cache", progress=False) == path
    monkeypatch.undo()
    (folder / "b.txt").write_text("Changed document, other size.\n")
    assert tokenize_cached(files, tmp_path / "cache", progress=False) != path


def test_lr_schedule_and_weight_decay_groups() -> None:
    a = parse_config(
        [
            "--data",
            "x",
            "--out",
            "y",
            "--lr",
            "1e-3",
            "--min-lr",
            "1e-4",
            "--warmup-steps",
            "10",
            "--max-steps",
            "110",
        ]
    )
    assert lr_at(0, a) == pytest.approx(1e-4)
    assert lr_at(9, a) == pytest.approx(1e-3)
    assert lr_at(60, a) == pytest.approx(5.5e-4)
    assert lr_at(110, a) == pytest.approx(1e-4)
    lrs = [lr_at(s, a) for s in range(10, 111)]
    assert all(x >= y for x, y in zip(lrs, lrs[1:]))
    model = GPT(ModelConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16))
    opt = make_optimizer(model, a.lr, a.weight_decay, (a.beta1, a.beta2))
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"])
    assert all(p.dim() == 1 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_non_finite_loss_skips_steps_then_stops(
    tmp_path: Path, data_slice: Path, cache_dir: Path, capsys: pytest.CaptureFixture
) -> None:
    model = GPT(ModelConfig(block_size=32, n_layer=2, n_head=2, n_embd=64))
    with torch.no_grad():
        model.transformer.h[0].ln_1.weight.fill_(float("nan"))
    save_checkpoint(model, tmp_path / "nan")
    code = train.main(
        [
            "--data",
            str(data_slice),
            "--out",
            str(tmp_path / "out"),
            "--cache-dir",
            str(cache_dir),
            "--init-from",
            str(tmp_path / "nan"),
            "--max-steps",
            "50",
            "--eval-interval",
            "100",
            "--log-interval",
            "1",
        ]
    )
    err = capsys.readouterr().err
    assert code == 1
    assert "error: loss or gradient not finite for 5 consecutive steps" in err
    rows = read_metrics(tmp_path / "out")
    assert len(rows) == 4 and all(r["skipped"] for r in rows)


def test_init_from_hugging_face_gpt2_then_resume(
    tmp_path: Path, data_slice: Path, cache_dir: Path, capsys: pytest.CaptureFixture
) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(n_positions=32, n_embd=64, n_layer=2, n_head=2))
    hf.save_pretrained(tmp_path / "hf")
    out = tmp_path / "out"
    base = [
        "--data",
        str(data_slice),
        "--out",
        str(out),
        "--cache-dir",
        str(cache_dir),
        "--batch-size",
        "4",
        "--eval-interval",
        "2",
        "--eval-iters",
        "2",
        "--sample-tokens",
        "0",
        "--log-interval",
        "1",
    ]
    assert run_main([*base, "--init-from", str(tmp_path / "hf"), "--max-steps", "2"], capsys) == 0
    state = torch.load(out / STATE_FILE, weights_only=True)
    assert state["args"]["n_embd"] == 64 and state["args"]["block_size"] == 32
    # Resuming needs neither the HF directory nor the architecture flags.
    (tmp_path / "hf" / "model.safetensors").unlink()
    assert run_main(["--out", str(out), "--resume", "--max-steps", "4"], capsys) == 0
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3, 4]
    assert load_checkpoint(out).config.n_layer == 2


def _error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_errors_are_one_line(
    tmp_path: Path, data_slice: Path, cache_dir: Path, trained: Path, capsys: pytest.CaptureFixture
) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    short = tmp_path / "short.txt"
    short.write_text("To be, or not to be, that is the question.\n")
    (tmp_path / "nofiles").mkdir()
    base = ["--cache-dir", str(cache_dir), *TINY, "--max-steps", "2"]
    cases = {
        "does not exist": ["--data", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "o")],
        "is empty": ["--data", str(empty), "--out", str(tmp_path / "o")],
        "has no .txt files": ["--data", str(tmp_path / "nofiles"), "--out", str(tmp_path / "o")],
        "too few for --block-size 32": ["--data", str(short), "--out", str(tmp_path / "o")],
        "holds a run; --resume continues it, --overwrite starts over in it": [
            "--data",
            str(data_slice),
            "--out",
            str(trained),
            "--n-layer",
            "3",
        ],
        "--resume continues the run in --out and --overwrite starts over: not both": [
            "--out",
            str(trained),
            "--resume",
            "--overwrite",
        ],
        "divisible by n_head": [
            "--data",
            str(data_slice),
            "--out",
            str(tmp_path / "o"),
            "--n-head",
            "3",
        ],
        "unrecognized arguments: --bogus": ["--data", str(data_slice), "--out", "o", "--bogus"],
        "invalid int value": ["--data", str(data_slice), "--out", "o", "--n-layer", "two"],
        "cannot change it to 4": ["--out", str(trained), "--resume", "--n-layer", "4"],
        "nothing to resume": ["--out", str(tmp_path / "fresh"), "--resume"],
        "--lr must be positive": ["--data", str(data_slice), "--out", "o", "--lr", "0"],
        "--init-from takes the architecture": [
            "--data",
            str(data_slice),
            "--out",
            "o",
            "--init-from",
            str(trained),
            "--n-layer",
            "4",
        ],
    }
    for expected, argv in cases.items():
        code = train.main([*base, *argv])
        line = _error_line(capsys.readouterr().err)
        assert code == 2 and expected in line, (expected, line)
    assert not (tmp_path / "o" / "config.json").exists()


def test_cli_error_has_no_traceback(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "train.py"),
            "--data",
            str(tmp_path / "nope"),
            "--out",
            str(tmp_path / "o"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: data path {tmp_path / 'nope'} does not exist"
