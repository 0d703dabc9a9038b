"""What the training tests share: a slice of the corpus to train on, and a run's metrics."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def text(shakespeare_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The first 60 kB of Shakespeare."""
    path = tmp_path_factory.mktemp("data") / "slice.txt"
    with open(shakespeare_path, encoding="utf-8") as f:
        path.write_text(f.read(60_000), encoding="utf-8")
    return path


def metric_rows(out: Path) -> list[dict]:
    """A run's metrics.jsonl rows without their timings (`tokens_per_s`), which no two runs
    share."""
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k != "tokens_per_s"} for line in lines]
