"""What the KV cache costs, as the server reports it: bytes a cached token takes, counted over
the model's key/value heads (grouped-query attention stores fewer than its query heads)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from gptserve.model import GPT, ModelConfig, save_checkpoint
from gptserve.server.metrics import Metrics
from gptserve.server.runtime import ServerState
from gptserve.server.settings import Settings, build_parser


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
    with caplog.at_level(logging.INFO, logger="gptserve.server.runtime"):
        state.start_loading().join(120)
    try:
        assert state.ready, state.load_error
        # keys and values, 2 layers, 2 KV heads of 16, float32 or --kv-cache-dtype's
        per_token = 2 * 2 * 2 * 16 * itemsize
        assert f"gptserve_kv_cache_bytes_per_token {float(per_token)}" in metrics.render().decode()
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("serving ")]
        assert len(lines) == 1 and f", {per_token} bytes a token)" in lines[0]
        # no --kv-cache-gb: the larger of 2 full contexts and 512 tokens for each of 2 sequences
        tokens = max(2 * 64, 2 * 512)
        assert f"the KV cache holds {tokens} tokens, {tokens * per_token / 1e6:.0f} MB at most" in lines[0]  # fmt: skip
        assert state.async_engine.limits.kv_cache_blocks * 16 == tokens
    finally:
        state.stop()


def test_kv_cache_gb_sets_the_pool_and_the_default_follows_the_context(tmp_path: Path) -> None:
    torch.manual_seed(0)
    save_checkpoint(
        GPT(ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=2048)), tmp_path / "m"
    )
    for flags, blocks in [({}, 2 * 2048 // 16), ({"kv_cache_gb": 0.001}, 0.001 * 2**30 // (16 * 2 * 2 * 32 * 4))]:  # fmt: skip
        state = ServerState(Settings(model=str(tmp_path / "m"), max_num_seqs=4, **flags), Metrics())
        state.start_loading().join(120)
        try:
            assert state.ready, state.load_error
            assert state.async_engine.limits.kv_cache_blocks == blocks
        finally:
            state.stop()


def test_a_cpu_pool_takes_memory_as_it_is_written() -> None:
    from gptserve.kernels.backends import zeroed_pool

    def resident() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    before = resident()
    pool = zeroed_pool((4, 4096, 16, 4, 64), torch.float32, "cpu")  # 256 MiB
    assert pool.shape == (4, 4096, 16, 4, 64) and pool.is_contiguous()
    assert resident() - before < 32 << 20  # not touched at start
    pool[0, :64] = 1.0  # 64 blocks of one layer: 1 MiB
    assert resident() - before < 48 << 20
    assert pool[0, :64].eq(1).all() and pool[1:].count_nonzero() == 0


def test_a_kv_cache_dtype_the_server_does_not_have_is_a_one_line_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["--kv-cache-dtype", "int4"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--kv-cache-dtype" in err and "invalid choice: 'int4'" in err
