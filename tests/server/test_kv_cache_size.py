"""What the KV cache costs, as the server reports it: bytes a cached token takes, counted over
the model's key/value heads (grouped-query attention stores fewer than its query heads)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from model import GPT, ModelConfig, save_checkpoint
from server.metrics import Metrics
from server.runtime import ServerState
from server.settings import Settings


def test_metrics_and_the_startup_line_give_the_kv_bytes_a_token(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    torch.manual_seed(0)
    config = ModelConfig(
        n_layer=2, n_head=6, n_kv_head=2, n_embd=96, pos_encoding="rotary", norm="rmsnorm",
        activation="swiglu", bias=False, block_size=64,
    )  # fmt: skip
    save_checkpoint(GPT(config), tmp_path / "gqa")
    metrics = Metrics()
    state = ServerState(Settings(model=str(tmp_path / "gqa"), max_num_seqs=2), metrics)
    with caplog.at_level(logging.INFO, logger="server.runtime"):
        state.start_loading().join(120)
    try:
        assert state.ready, state.load_error
        per_token = 2 * 2 * 2 * 16 * 4  # keys and values, 2 layers, 2 KV heads of 16, float32
        assert f"gptserve_kv_cache_bytes_per_token {float(per_token)}" in metrics.render().decode()
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("serving ")]
        assert len(lines) == 1 and f", {per_token} KV bytes a token)" in lines[0]
    finally:
        state.stop()
