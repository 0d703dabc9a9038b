"""What docs/TRAINING.md promises about the training package and its output files.

- training/ has no import cycle; its TrainConfig is frozen and derived values are computed;
- metrics.jsonl: a fresh run starts it over, --resume keeps the lines up to its checkpoint
  byte for byte and appends after them (a killed run's later lines are dropped);
- loss.png is a 700 x 400 PNG redrawn at every eval when matplotlib is there, absent without it;
- --resume auto starts a run when --out holds none and continues it when it does.
In-process runs of a one-layer model on a 20 kB slice of Shakespeare.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import struct
import sys
from pathlib import Path

import pytest
import torch
from gptserve.training import cli as train
from gptserve.training.args import parse_config
from gptserve.training.checkpointing import STATE_FILE

TRAINING = Path(__file__).resolve().parents[2] / "training"
TINY = [
    "--n-layer",
    "1",
    "--n-head",
    "2",
    "--n-embd",
    "32",
    "--block-size",
    "16",
    "--batch-size",
    "2",
    "--eval-iters",
    "1",
    "--sample-tokens",
    "0",
    "--log-interval",
    "1",
    "--warmup-steps",
    "1",
]


@pytest.fixture(scope="module")
def data(shakespeare_path: Path, tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """--data and --cache-dir for a 20 kB slice, shared by the runs of this module."""
    root = tmp_path_factory.mktemp("outputs")
    path = root / "slice.txt"
    with open(shakespeare_path, encoding="utf-8") as f:
        path.write_text(f.read(20_000), encoding="utf-8")
    return ["--data", str(path), "--cache-dir", str(root / "cache")]


def run(argv: list[str], capsys: pytest.CaptureFixture) -> None:
    code = train.main(argv)
    err = capsys.readouterr().err
    assert code == 0, err


def metrics_lines(out: Path) -> list[str]:
    return (out / "metrics.jsonl").read_text().splitlines()


def test_training_modules_import_without_cycles() -> None:
    graph: dict[str, set[str]] = {}
    for path in TRAINING.glob("*.py"):
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                if node.module.startswith("gptserve.training."):
                    deps.add(node.module.split(".")[2])
                elif node.module == "gptserve.training":
                    deps.update(alias.name for alias in node.names)
            elif isinstance(node, ast.Import):
                deps.update(
                    a.name.split(".")[2]
                    for a in node.names
                    if a.name.startswith("gptserve.training.")
                )
        graph[path.stem] = deps
    assert graph["errors"] == set() and graph["loop"] != set()
    order: list[str] = []  # a topological order exists iff there is no cycle
    while len(order) < len(graph):
        ready = sorted(m for m, deps in graph.items() if m not in order and deps <= set(order))
        assert ready, f"import cycle among {sorted(set(graph) - set(order))}"
        order += ready
    # the loop is the top, under the command line (cli.py and its __main__)
    assert not any("loop" in deps for m, deps in graph.items() if m not in ("cli", "__main__"))


def test_config_is_frozen_and_derives_min_lr(tmp_path: Path) -> None:
    cfg = parse_config(["--data", "d.txt", "--out", str(tmp_path), "--lr", "1e-3"])
    assert cfg.min_lr is None and cfg.final_lr == pytest.approx(1e-4)
    assert cfg.token_cache == tmp_path / "cache" and cfg.data == Path("d.txt")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.lr = 1.0  # type: ignore[misc]
    cfg = parse_config(["--data", "d.txt", "--out", "o", "--min-lr", "0", "--cache-dir", "c"])
    assert cfg.final_lr == 0.0 and cfg.token_cache == Path("c")
    saved = cfg.to_dict()
    assert saved["out"] == "o" and saved["init_from"] is None and saved["resume"] is False


def test_metrics_start_over_fresh_and_append_on_resume(
    data: list[str], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "run"
    base = [*data, "--out", str(out), *TINY, "--eval-interval", "2"]
    run([*base, "--max-steps", "4"], capsys)
    first = metrics_lines(out)
    assert [json.loads(line)["step"] for line in first] == [1, 2, 3, 4]
    # A killed run went on after its step-4 checkpoint: a whole line and a torn one.
    with open(out / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 5, "train_loss": 123.0, "lr": 1.0}) + "\n")
        f.write('{"step": 6, "train_lo')
    run(["--out", str(out), "--resume", "--max-steps", "6"], capsys)
    lines = metrics_lines(out)
    assert lines[:4] == first  # kept byte for byte
    rows = [json.loads(line) for line in lines[4:]]
    assert [r["step"] for r in rows] == [5, 6]
    assert rows[0]["train_loss"] < 12 and "val_loss" in rows[1]  # the resumed run's own rows
    # A new run over it (--overwrite) starts the file over.
    run([*base, "--max-steps", "2", "--overwrite"], capsys)
    assert [json.loads(line)["step"] for line in metrics_lines(out)] == [1, 2]


def png_size(path: Path) -> tuple[int, int]:
    raw = path.read_bytes()
    assert raw[:8] == b"\x89PNG\r\n\x1a\n" and raw[12:16] == b"IHDR"
    return struct.unpack(">II", raw[16:24])


def test_loss_png_is_redrawn_at_every_eval(
    data: list[str], tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("matplotlib")
    import gptserve.training.loop as training_loop

    drawn: list[list[int]] = []
    real_plot = training_loop.plot_losses

    def plot(metrics: Path, target: Path) -> None:
        drawn.append([json.loads(line)["step"] for line in metrics.read_text().splitlines()])
        real_plot(metrics, target)

    monkeypatch.setattr(training_loop, "plot_losses", plot)
    run([*data, "--out", str(tmp_path), *TINY, "--max-steps", "5", "--eval-interval", "2"], capsys)
    assert drawn == [[1, 2], [1, 2, 3, 4], [1, 2, 3, 4, 5]]  # evals at 2, 4 and the last step
    assert png_size(tmp_path / "loss.png") == (700, 400)


def test_no_loss_png_without_matplotlib(
    data: list[str], tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails
    run([*data, "--out", str(tmp_path), *TINY, "--max-steps", "2", "--eval-interval", "1"], capsys)
    assert not (tmp_path / "loss.png").exists()
    assert [json.loads(line)["step"] for line in metrics_lines(tmp_path)] == [1, 2]
    assert (tmp_path / "model.safetensors").is_file()


def test_resume_auto_starts_then_continues(
    data: list[str], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "run"
    argv = [*data, "--out", str(out), *TINY, "--eval-interval", "2", "--resume", "auto"]
    run([*argv, "--max-steps", "2"], capsys)  # nothing in --out: a new run
    state = torch.load(out / STATE_FILE, weights_only=True)
    assert state["step"] == 2 and state["args"]["resume"] is False
    run([*argv, "--max-steps", "4"], capsys)  # a run in --out: continued
    state = torch.load(out / STATE_FILE, weights_only=True)
    assert state["step"] == 4 and state["args"]["resume"] is True
    assert [json.loads(line)["step"] for line in metrics_lines(out)] == [1, 2, 3, 4]
    code = train.main(["--out", str(tmp_path / "empty"), "--resume", "auto"])
    assert code == 2 and capsys.readouterr().err.strip() == "error: --data PATH is required"
    code = train.main([*argv, "--resume", "sometimes"])
    err = capsys.readouterr().err
    assert code == 2 and "--resume takes no value or 'auto', got 'sometimes'" in err
