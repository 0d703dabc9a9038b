"""metrics.jsonl (one JSON line per logged step, appended) and loss.png (redrawn from it)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
LOSS_PLOT = "loss.png"


def append_metrics(path: Path, row: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def trim_metrics(path: Path, last_step: int) -> None:
    """Drop lines logged after the checkpoint we resume from (a killed run may have gone on)."""
    if not path.is_file():
        return
    rows = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= last_step:
                rows.append(line)
        except (json.JSONDecodeError, KeyError, TypeError):
            continue  # a line cut short by the kill
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(r + "\n" for r in rows))
    os.replace(tmp, path)


def plot_losses(metrics: Path, target: Path) -> None:
    """DIR/loss.png from metrics.jsonl; silently nothing when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in rows], [r["train_loss"] for r in rows], label="train")
    val = [r for r in rows if "val_loss" in r]
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="val")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    ax.grid(alpha=0.3)
    tmp = target.with_name(f".{target.name}.tmp")
    fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)
    os.replace(tmp, target)
