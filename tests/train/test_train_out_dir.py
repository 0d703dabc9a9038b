"""A run is never overwritten by accident: a new run over an --out that holds one is refused
(unless --resume or --overwrite), and --resume checks that it continues on the same data."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from gptserve.training import cli as train
from gptserve.training.checkpointing import STATE_FILE

FAST = ["--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--block-size", "16",
        "--batch-size", "4", "--eval-iters", "1", "--sample-tokens", "0",
        "--eval-interval", "3"]  # fmt: skip


def _digest(folder: Path) -> dict[str, str]:
    """Every file under `folder` (the token cache aside) by its content."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and "cache" not in p.parts
    }


@pytest.fixture()
def texts(shakespeare_path: Path, tmp_path: Path) -> tuple[Path, Path]:
    text = shakespeare_path.read_text(encoding="utf-8")
    first, second = tmp_path / "first.txt", tmp_path / "second.txt"
    first.write_text(text[:40_000], encoding="utf-8")
    second.write_text(text[40_000:80_000], encoding="utf-8")
    return first, second


def _error(capsys: pytest.CaptureFixture) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines and lines[-1].startswith("error: ") and "Traceback" not in "\n".join(lines)
    return lines[-1]


@pytest.mark.timeout(300)
def test_a_second_run_never_replaces_the_first(texts, tmp_path: Path, capsys) -> None:
    first, second = texts
    out = tmp_path / "run"
    base = ["--data", str(first), "--out", str(out), *FAST]
    assert train.main([*base, "--max-steps", "6"]) == 0
    before = _digest(out)
    assert torch.load(out / STATE_FILE, weights_only=True)["step"] == 6

    # the same command again, or a fine-tune into it: refused, nothing touched
    for extra in ([], ["--max-steps", "3"], ["--init-from", str(out)]):
        capsys.readouterr()
        argv = [*base, *extra] if "--init-from" not in extra else [
            "--data", str(first), "--out", str(out), "--init-from", str(out), "--max-steps", "3"]  # fmt: skip
        assert train.main(argv) == 2
        assert f"--out {out} holds a run; --resume continues it" in _error(capsys)
        assert _digest(out) == before

    # --resume on other data says so, and changes nothing
    capsys.readouterr()
    other = ["--data", str(second), "--out", str(out), "--resume", "--max-steps", "9"]
    assert train.main(other) == 2
    line = _error(capsys)
    assert "is not the data the run" in line and f"--init-from {out}" in line
    assert _digest(out) == before

    # --resume on the same data continues it
    assert (
        train.main(["--data", str(first), "--out", str(out), "--resume", "--max-steps", "9"]) == 0
    )
    assert torch.load(out / STATE_FILE, weights_only=True)["step"] == 9

    # --overwrite starts over, on any data
    assert train.main(["--data", str(second), "--out", str(out), *FAST, "--max-steps", "3",
                       "--overwrite"]) == 0  # fmt: skip
    assert torch.load(out / STATE_FILE, weights_only=True)["step"] == 3


def test_a_folder_with_a_model_is_refused_too(texts, tmp_path: Path, capsys) -> None:
    out = tmp_path / "model"
    out.mkdir()
    (out / "config.json").write_text("{}")
    assert train.main(["--data", str(texts[0]), "--out", str(out), *FAST, "--max-steps", "1"]) == 2
    assert f"--out {out} holds a model;" in _error(capsys)
    assert (out / "config.json").read_text() == "{}"
