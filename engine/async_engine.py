"""Drives the Engine from a background thread and hands each request's events to asyncio.

The model never runs on the event loop. Requests and aborts are posted to the engine thread and
applied between steps, so an abort frees its blocks before the next step runs.

A failed step fails only its own requests, but a fault that fails every step (a device-side
assert, a corrupted pool) would leave a process that looks alive and serves nothing: after
`max_consecutive_failed_steps` failed steps in a row the engine is `unhealthy`, fails what it
holds and takes no more work, and `on_failure` tells the server (which answers 503 and may exit).

The engine thread also builds the Engine, so that on a CPU one thread does all of the model's
parallel work. PyTorch's OpenMP thread pool belongs to the thread that runs parallel work; a
second pool (say the main thread's, from building the Engine there) means more OpenMP threads than
cores, and then libgomp puts its workers to sleep between parallel regions instead of spinning.
Building the Engine here took `python bench/serve.py`'s server/offline ratio from 0.85 to 0.98.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TypeVar

from gptserve.engine.engine import Engine
from gptserve.engine.limits import EngineLimits
from gptserve.engine.sampler import SamplingParams
from gptserve.engine.sequence import SEQUENCE_ERROR, TokenEvent

log = logging.getLogger(__name__)
T = TypeVar("T")
Deliver = Callable[[TokenEvent], None]  # called on the request's event loop, per event


class EngineDeadError(RuntimeError):
    """The engine thread has stopped; no request can be served."""

    code = "engine_dead"


class EngineUnhealthyError(EngineDeadError):
    """Too many engine steps failed in a row; the engine takes no more work."""

    code = "engine_unhealthy"


@dataclass(frozen=True)
class StepStats:
    """What one engine step did, for the metrics."""

    events: list[TokenEvent]
    seconds: float
    preempted: int  # sequences preempted (requeued to be recomputed) by this step
    prefix_queried: int = 0  # prompt tokens looked up in the prefix cache by this step
    prefix_hit: int = 0  # of those, tokens found there
    spec_proposed: int = 0  # speculative guesses verified by this step
    spec_accepted: int = 0  # of those, guesses the model agreed with


class AsyncEngine:
    def __init__(
        self, build: Callable[[], Engine], max_consecutive_failed_steps: int | None = None
    ) -> None:
        self._build = build
        self.max_consecutive_failed_steps = max_consecutive_failed_steps  # None: never give up
        self.consecutive_failed_steps = 0
        self.unhealthy: str | None = None  # why the engine gave up on a sticky fault, if it did
        self.on_failure: Callable[[str], None] | None = None  # unhealthy or dead: why, once
        self.engine: Engine | None = None  # built by start()
        self._built = threading.Event()
        self._build_error: BaseException | None = None
        self._lock = threading.Lock()
        self._inbox: list[Callable[[], None]] = []
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, Deliver, int]] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.dead: str | None = None  # why the engine thread stopped, if it did
        self.on_step: Callable[[StepStats], None] | None = None
        self.pending_adds = 0
        self.limits: EngineLimits | None = None  # set once the Engine is built

    # ---- lifecycle ------------------------------------------------------------------------

    def start(self) -> Engine:
        """Start the engine thread, wait until it has built the Engine, and return it.

        Raises what building raised (the thread then ends).
        """
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()
        self._built.wait()
        if self._build_error is not None:
            raise self._build_error
        return self.engine

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def num_waiting(self) -> int:
        return self.engine.num_waiting + self.pending_adds

    @property
    def num_running(self) -> int:
        return self.engine.num_running

    @property
    def num_failed_steps(self) -> int:
        return self.engine.num_failed_steps

    @property
    def kv_usage(self) -> float:
        return self.engine.kv_usage

    @property
    def kv_bytes_per_token(self) -> int:
        """Key and value bytes one cached token takes: layers x KV heads x head dim x dtype."""
        return self.engine.pools.bytes_per_token

    @property
    def num_requests(self) -> int:
        return len(self._streams)

    # ---- requests -------------------------------------------------------------------------

    async def generate(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams,
        admitted: bool = False,
    ) -> AsyncIterator[TokenEvent]:  # fmt: skip
        """Events of one request until all its n completions end. Closing the iterator aborts it.

        admitted: the server admitted it (`engine.limits`) and the engine takes it unchecked;
        else the engine checks it, and should it refuse it every completion gets one error event.
        """
        queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self.submit(request_id, prompt_ids, params, queue.put_nowait, admitted)
        remaining = params.n
        try:
            while remaining:
                event = await queue.get()
                if event.finished:
                    remaining -= 1
                yield event
        finally:
            self.release(request_id, aborted=remaining > 0)

    def submit(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, deliver: Deliver,
        admitted: bool = False,
    ) -> None:  # fmt: skip
        """Queue a request whose events `deliver` gets, one call per event, on the running event
        loop (the one calling this), until each of its n completions has had its last event
        (`TokenEvent.finished`); then, or to give up on it earlier, call `release`.

        The way `generate` and the server's streams take events without a task of their own in
        between: a step's events for one loop reach it in one wake-up. `admitted` as `generate`'s.
        Raises EngineDeadError (or EngineUnhealthyError) when the engine takes no more work.
        """
        if self.dead:
            raise EngineDeadError(self.dead)
        if self.unhealthy:
            raise EngineUnhealthyError(self.unhealthy)
        self._streams[request_id] = (asyncio.get_running_loop(), deliver, params.n)
        with self._lock:  # += and -= from two threads would lose updates
            self.pending_adds += 1
        self._post(lambda: self._add(request_id, prompt_ids, params, admitted))

    def release(self, request_id: str, aborted: bool) -> None:
        """A submitted request's events are no longer wanted; `aborted`: some of its completions
        have not ended, and the engine frees their sequences before its next step."""
        self._streams.pop(request_id, None)
        if aborted:
            self.abort(request_id)

    async def run_on_engine(self, work: Callable[[Engine], T], timeout: float = 60.0) -> T:
        """`work(engine)` run on the engine thread between two steps (so nothing else changes
        the engine meanwhile): its result, or what it raised. Raises EngineDeadError when the
        engine cannot run it, TimeoutError when it has not within `timeout` seconds."""
        if self.dead:
            raise EngineDeadError(self.dead)
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()

        def settle(result: object, error: BaseException | None) -> None:
            if future.done():  # the caller gave up waiting
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)

        def command() -> None:
            try:
                result, error = work(self.engine), None
            except Exception as exc:
                result, error = None, exc
            try:
                loop.call_soon_threadsafe(settle, result, error)
            except RuntimeError:  # the loop closed under us (shutdown)
                pass

        self._post(command)
        return await asyncio.wait_for(future, timeout)

    def abort(self, request_id: str) -> None:
        """Free the request's sequences before the next engine step."""
        self._post(lambda: self.engine.abort(request_id))

    def finish(self, request_id: str, index: int) -> None:
        """End completion `index` of the request before the next engine step (`Engine.finish`):
        its stream gets its last event, finish reason "stop", unless it has ended already."""
        self._post(lambda: self._deliver(self.engine.finish(request_id, index)))

    def _add(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, admitted: bool
    ) -> None:
        with self._lock:
            self.pending_adds -= 1
        if request_id not in self._streams:  # the client left before the engine saw it
            return
        if self.unhealthy:  # posted before the engine gave up
            self._deliver(_errors(request_id, params.n, self.unhealthy))
            return
        try:
            self.engine.add_request(request_id, prompt_ids, params, admitted=admitted)
        except ValueError as exc:
            self._deliver(
                [
                    TokenEvent(request_id, i, [], "", [], error=str(exc), error_code=SEQUENCE_ERROR)
                    for i in range(params.n)
                ]
            )

    def _post(self, command: Callable[[], None]) -> None:
        with self._lock:
            self._inbox.append(command)
        self._wake.set()

    # ---- the engine thread ----------------------------------------------------------------

    def _run(self) -> None:
        try:
            self.engine = engine = self._build()
            self.limits = engine.limits
        except BaseException as exc:
            self._build_error = exc
            return
        finally:
            self._built.set()
        self._loop()

    def _loop(self) -> None:
        try:
            while not self._stopping:
                with self._lock:
                    commands, self._inbox = self._inbox, []
                for command in commands:
                    command()
                if self.engine.has_work():
                    t0 = time.perf_counter()
                    before = self._counts()
                    failed_before = self.engine.num_failed_steps
                    events = self.engine.step()
                    self._deliver(events)
                    self._count_failure(self.engine.num_failed_steps > failed_before, events)
                    if self.on_step is not None:
                        counts = (now - then for now, then in zip(self._counts(), before))
                        self.on_step(StepStats(events, time.perf_counter() - t0, *counts))
                else:
                    self._wake.wait(0.1)
                    self._wake.clear()
        except BaseException as exc:  # keep the reason; every waiting client gets an error
            log.exception("engine thread died: %s", exc)
            self.dead = (
                "the engine thread stopped on an internal error (the server log has details)"
            )
            self._fail_all(self.dead)
            self._report(self.dead)

    def _count_failure(self, failed: bool, events: list[TokenEvent]) -> None:
        """Count a step's outcome; past the limit of failed steps in a row, give up."""
        if not failed:
            self.consecutive_failed_steps = 0
            return
        self.consecutive_failed_steps += 1
        limit = self.max_consecutive_failed_steps
        if self.unhealthy or limit is None or self.consecutive_failed_steps < limit:
            return
        steps = "engine step" if limit == 1 else f"{limit} engine steps in a row"
        self.unhealthy = f"the last {steps} failed (the server log has details)"
        log.error("the engine is unhealthy and takes no more work: %s", self.unhealthy)
        for rid in list(self._streams):
            self.engine.abort(rid)
        self._fail_all(self.unhealthy)
        self._report(self.unhealthy)

    def _fail_all(self, message: str) -> None:
        """Every request still waiting for events gets one error event per completion."""
        for rid, (_, _, n) in list(self._streams.items()):
            self._deliver(_errors(rid, n, message))

    def _report(self, reason: str) -> None:
        if self.on_failure is not None:
            try:
                self.on_failure(reason)
            except Exception:  # the engine's state already says it; a callback cannot undo it
                log.exception("the engine failure callback failed")

    def _counts(self) -> tuple[int, ...]:
        """The engine's running totals that StepStats reports per step."""
        blocks, spec = self.engine.blocks, self.engine.speculator
        guesses = (spec.proposed_tokens, spec.accepted_tokens) if spec else (0, 0)
        return (self.engine.num_preemptions, blocks.prefix_queried_tokens, blocks.prefix_hit_tokens,
                *guesses)  # fmt: skip

    def _deliver(self, events: list[TokenEvent]) -> None:
        """Hand events to their requests' event loops: one wake-up a loop for all of them (a
        wake-up costs the loop more than handing an event over, and it takes the GIL from this
        thread while the next step runs)."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[Deliver, TokenEvent]]] = {}
        for event in events:
            target = self._streams.get(event.request_id)
            if target is not None:
                loop, deliver, _ = target
                batch = batches.get(loop)
                if batch is None:
                    batches[loop] = batch = []
                batch.append((deliver, event))
        for loop, batch in batches.items():
            try:
                loop.call_soon_threadsafe(_hand_over, batch)
            except RuntimeError:  # the loop closed under us (shutdown)
                pass


def _hand_over(batch: list[tuple[Deliver, TokenEvent]]) -> None:
    """On the event loop: each event to its request (a failing receiver fails only its own)."""
    for deliver, event in batch:
        try:
            deliver(event)
        except Exception:
            log.exception("handing an event of %s over failed", event.request_id)


def _errors(request_id: str, n: int, message: str) -> list[TokenEvent]:
    """One error event for each of a request's n completions."""
    return [TokenEvent(request_id, i, [], "", [], error=message) for i in range(n)]
