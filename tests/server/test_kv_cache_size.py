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
from server.settings import Settings, build_parser


@pytest.mark.parametrize("kv_cache_dtype, itemsize", [("auto", 4), ("float16", 2), ("bfloat16", 2)])
def test_metrics_and_the_startup_line_give_the_kv_bytes_a_token(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, kv_cache_dtype: str, itemsize: int
) -> None:
    torch.manual_seed(0)
    config = ModelConfig(
        n_layer=2, n_head=6, n_kv_head=2, n_embd=96, pos_encoding="rotary", norm="rmsnorm",
        activation="swiglu", bias=False, block_size=64,
    )  # fmt: skip
    save_checkpoint(GPT(config), tmp_path / "gqa")
    metrics = Metrics()
    settings = Settings(model=str(tmp_path / "gqa"), max_num_seqs=2, kv_cache_dtype=kv_cache_dtype)
    state = ServerState(settings, metrics)
    with caplog.at_level(logging.INFO, logger="server.runtime"):
        state.start_loading().join(120)
    try:
        assert state.ready, state.load_error
        # keys and values, 2 layers, 2 KV heads of 16, float32 or --kv-cache-dtype's
        per_token = 2 * 2 * 2 * 16 * itemsize
        assert f"gptserve_kv_cache_bytes_per_token {float(per_token)}" in metrics.render().decode()
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("serving ")]
        assert len(lines) == 1 and f", {per_token} KV bytes a token)" in lines[0]
    finally:
        state.stop()


def test_a_kv_cache_dtype_the_server_does_not_have_is_a_one_line_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["--kv-cache-dtype", "int4"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--kv-cache-dtype" in err and "invalid choice: 'int4'" in err
