"""AsyncEngine's hand-over: a step's events reach an event loop in one wake-up, each request's
`deliver` gets its own in order, and `release` aborts what has not ended."""

from __future__ import annotations

import asyncio
from pathlib import Path

from gptserve.engine.async_engine import AsyncEngine
from gptserve.engine.engine import Engine, EngineConfig
from gptserve.engine.sampler import SamplingParams
from gptserve.engine.sequence import TokenEvent
from gptserve.model import get_tokenizer, load_checkpoint


def started(checkpoint: Path) -> AsyncEngine:
    model = load_checkpoint(checkpoint)
    async_engine = AsyncEngine(
        lambda: Engine(model, get_tokenizer(), EngineConfig(max_num_seqs=4, num_blocks=32))
    )
    async_engine.start()
    return async_engine


def test_a_steps_events_reach_the_loop_in_one_wake_up(tiny_checkpoint: Path):
    async_engine = started(tiny_checkpoint)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, n=2)
    try:

        async def run() -> tuple[dict[str, list[TokenEvent]], list[int]]:
            loop = asyncio.get_running_loop()
            wake_ups: list[int] = []  # events handed over by each call from the engine thread
            original = loop.call_soon_threadsafe

            def counting(callback, *args, **kwargs):  # noqa: ANN001, ANN202
                if args and isinstance(args[0], list):  # a batch of (deliver, event)
                    wake_ups.append(len(args[0]))
                return original(callback, *args, **kwargs)

            loop.call_soon_threadsafe = counting
            got: dict[str, list[TokenEvent]] = {"a": [], "b": []}
            done = asyncio.Event()
            left = {"a": 2, "b": 2}

            def deliverer(rid: str):  # noqa: ANN202
                def deliver(event: TokenEvent) -> None:
                    got[rid].append(event)
                    left[rid] -= event.finished
                    if not any(left.values()):
                        done.set()

                return deliver

            # both posted before the engine thread wakes: they run in the same steps
            async_engine.submit("a", [1, 2, 3], params, deliverer("a"))
            async_engine.submit("b", [4, 5, 6, 7], params, deliverer("b"))
            await asyncio.wait_for(done.wait(), 60)
            async_engine.release("a", aborted=False)
            async_engine.release("b", aborted=False)
            return got, wake_ups

        got, wake_ups = asyncio.run(run())
    finally:
        async_engine.stop()
    for rid in ("a", "b"):
        for index in (0, 1):
            events = [e for e in got[rid] if e.index == index]
            assert sum(len(e.token_ids) for e in events) == 5
            assert [e.finished for e in events][-1] and not any(e.finished for e in events[:-1])
    # four sequences decoding together: one wake-up carries the four events of a step
    assert max(wake_ups) == 4
    assert sum(wake_ups) == len(got["a"]) + len(got["b"])
    assert async_engine.num_requests == 0


def test_release_before_the_end_aborts_the_request(tiny_checkpoint: Path):
    async_engine = started(tiny_checkpoint)
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    try:

        async def run() -> int:
            first = asyncio.Event()
            async_engine.submit("long", [1, 2, 3], params, lambda event: first.set())
            await asyncio.wait_for(first.wait(), 60)
            async_engine.release("long", aborted=True)
            for _ in range(600):  # the abort runs before the engine's next step
                if async_engine.num_running == 0 and not async_engine.engine.has_work():
                    return async_engine.num_requests
                await asyncio.sleep(0.05)
            raise AssertionError("the released request kept running")

        assert asyncio.run(run()) == 0
    finally:
        async_engine.stop()
