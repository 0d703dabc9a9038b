"""AsyncEngine: the engine thread builds the Engine and does every model step."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
from gptserve.engine.async_engine import AsyncEngine
from gptserve.engine.engine import Engine, EngineConfig
from gptserve.engine.sampler import SamplingParams
from gptserve.model import get_tokenizer, load_checkpoint
from gptserve.server.runtime import ModelLoadError, load_model
from gptserve.server.settings import Settings


def test_the_engine_is_built_and_stepped_in_the_engine_thread(tiny_checkpoint: Path):
    model = load_checkpoint(tiny_checkpoint)
    threads: dict[str, str] = {}
    original = model.forward_cached

    def forward_cached(*args, **kwargs):
        threads["step"] = threading.current_thread().name
        return original(*args, **kwargs)

    model.forward_cached = forward_cached

    def build() -> Engine:
        threads["build"] = threading.current_thread().name
        return Engine(model, get_tokenizer(), EngineConfig(max_num_seqs=2, num_blocks=16))

    async_engine = AsyncEngine(build)
    engine = async_engine.start()
    try:
        assert isinstance(engine, Engine) and async_engine.engine is engine

        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)

        async def one() -> list[int]:
            return [
                t async for e in async_engine.generate("a", [1, 2, 3], params) for t in e.token_ids
            ]

        tokens = asyncio.run(one())
    finally:
        async_engine.stop()
    assert threads == {"build": "engine", "step": "engine"}
    # the same request run on an Engine directly: the same greedy tokens
    model.forward_cached = original
    offline = Engine(model, get_tokenizer(), EngineConfig(max_num_seqs=2, num_blocks=16))
    offline.add_request("b", [1, 2, 3], params)
    expected = []
    while offline.has_work():
        expected += [t for e in offline.step() for t in e.token_ids]
    assert len(tokens) == 3 and tokens == expected
    assert async_engine.limits.max_model_len == 256 and async_engine.limits.kv_cache_blocks == 16


def test_a_failing_build_is_raised_by_start_and_the_thread_ends():
    def build() -> Engine:
        raise ValueError("no room for the KV cache")

    async_engine = AsyncEngine(build)
    with pytest.raises(ValueError, match="no room"):
        async_engine.start()
    async_engine._thread.join(5)
    assert not async_engine._thread.is_alive() and async_engine.engine is None


def test_load_model_returns_the_model_or_raises_the_load_error(
    tiny_checkpoint: Path, tmp_path: Path
):
    loaded = load_model(Settings(model=str(tiny_checkpoint)))
    assert loaded.model.config.n_layer == 2 and loaded.name == tiny_checkpoint.name
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(Settings(model=str(tmp_path / "missing")))


def test_stop_while_the_engine_is_being_built_leaves_no_engine_running(
    tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
):
    import time

    import gptserve.server.runtime as state_module
    from gptserve.server.metrics import Metrics
    from gptserve.server.runtime import ServerState

    building = threading.Event()

    def slow_engine(*args, **kwargs) -> Engine:
        building.set()
        time.sleep(0.5)
        return Engine(*args, **kwargs)

    def engine_threads() -> set[threading.Thread]:  # other tests' servers may have their own
        return {t for t in threading.enumerate() if t.name == "engine" and t.is_alive()}

    before = engine_threads()
    monkeypatch.setattr(state_module, "Engine", slow_engine)
    settings = Settings(model=str(tiny_checkpoint), max_num_seqs=2)
    loaded = load_model(settings)
    state = ServerState(settings, Metrics(), loader=lambda _: loaded)
    starter = state.start_loading()
    assert building.wait(10)
    state.stop()  # the engine is half built: nothing to stop yet
    starter.join(10)
    assert state.async_engine is None and not state.ready
    assert engine_threads() <= before


def test_a_request_the_engine_refuses_ends_each_completion_with_an_error(tiny_checkpoint: Path):
    """The HTTP layer checks requests first (server.validation); should one still reach the
    engine and be refused there, each of its completions gets one error event."""
    model = load_checkpoint(tiny_checkpoint)
    async_engine = AsyncEngine(lambda: Engine(model, get_tokenizer(), EngineConfig(num_blocks=16)))
    async_engine.start()
    try:
        params = SamplingParams(max_tokens=10, n=2)

        async def run() -> list:
            return [e async for e in async_engine.generate("long", [1] * 300, params)]

        events = asyncio.run(run())
    finally:
        async_engine.stop()
    assert sorted(e.index for e in events) == [0, 1]
    assert all(e.finished and "maximum context length is 256" in e.error for e in events)
