"""The engine thread's hand-offs to the HTTP loop: what runs before what, on an engine whose steps the
test gates. No timings: every assertion is about order."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from batchkv.errors import TensorParallelError
from batchkv.executor import Event, Request, SamplingParams
from batchkv.serve import worker as worker_module
from batchkv.serve.metrics import ServerMetrics
from batchkv.serve.protocol import APIError
from batchkv.serve.stream import Deadlines
from batchkv.serve.worker import EngineWorker


class GatedEngine:
    """One token per live request per step, requests in submit order. Each step first runs
    `on_step` and then waits for the test to release `gate` (a semaphore; None: no wait)."""

    overlap = True
    cached_columns = 0  # the worker's prefix-cache hooks: nothing is cached
    kv_usage = (0, 64)  # (positions held, the store's)

    def __init__(self, on_step=lambda: None, gated: bool = False) -> None:
        self.on_step, self.gate = on_step, threading.Semaphore(0) if gated else None
        self.left: dict[int, int] = {}  # request id -> tokens still to emit
        self.steps: list[list[int]] = []  # the request ids each step emitted for
        self.cache = SimpleNamespace(sequences=[])
        self.runner = SimpleNamespace(captures=0)
        self.metrics = SimpleNamespace(step_times=[], inter_token=[], first_token=[])
        self.num_waiting = 0

    @property
    def has_work(self) -> bool:
        return bool(self.left)

    @property
    def num_running(self) -> int:
        return len(self.left)

    def submit(self, request: Request) -> int:
        rid = len(self.steps) * 100 + len(self.left)  # unique: new ids per step
        self.left[rid] = request.params.max_new_tokens
        return rid

    def cancel(self, rid: int) -> bool:
        return self.left.pop(rid, None) is not None

    def cached_tokens(self, rid: int) -> int | None:
        return 0 if rid in self.left else None

    def step(self) -> list[Event]:
        self.on_step()
        if self.gate is not None:
            self.gate.acquire()
        events = []
        for rid in list(self.left):
            self.left[rid] -= 1
            events.append(Event(rid, 7, "length" if self.left[rid] == 0 else None))
            if self.left[rid] == 0:
                del self.left[rid]
        self.steps.append([e.request_id for e in events])
        return events


def request(tokens: int) -> list[Request]:
    return [Request([1, 2], SamplingParams(max_new_tokens=tokens))]


async def started(engine: GatedEngine) -> EngineWorker:
    worker = EngineWorker(engine, ServerMetrics(4), max_waiting=8)  # type: ignore[arg-type]
    worker.start(asyncio.get_running_loop())
    return worker


async def read(stream, name: str, log: list) -> None:
    """Log (name, tokens so far) each time the loop runs this reader; end at the finish."""
    count = 0
    async for items in stream:
        count += sum(event.token is not None for _, event in items)
        log.append((name, count))
        if any(event.finish_reason is not None for _, event in items):
            return


def test_the_switch_interval_is_short_while_the_engine_thread_runs_and_restored_after():
    before = sys.getswitchinterval()

    async def main() -> float:
        worker = await started(GatedEngine())
        during = sys.getswitchinterval()
        await asyncio.to_thread(worker.stop)
        return during

    assert asyncio.run(main()) == pytest.approx(worker_module.SWITCH_INTERVAL_S)
    assert sys.getswitchinterval() == before


def test_an_overlapping_engine_plans_a_step_only_after_the_loop_wrote_the_last_steps_tokens(monkeypatch):
    monkeypatch.setattr(worker_module, "HANDOFF_S", 30.0)  # the cap: never reached unless the hand-off is broken
    log: list = []
    seen: list[list] = []  # what the loop's reader had logged when each step began
    engine = GatedEngine(on_step=lambda: seen.append(list(log)))

    async def main() -> None:
        worker = await started(engine)
        try:
            await read(await worker.submit(request(3), time.perf_counter()), "a", log)
        finally:
            await asyncio.to_thread(worker.stop)

    asyncio.run(main())
    assert seen == [[], [("a", 1)], [("a", 1), ("a", 2)]]


def test_a_request_posted_during_a_step_is_in_the_next_step_and_its_first_token_is_written_first(monkeypatch):
    monkeypatch.setattr(worker_module, "HANDOFF_S", 30.0)  # each step's readers run before the next step
    log: list = []
    engine = GatedEngine(gated=True)

    async def main() -> None:
        worker = await started(engine)
        try:
            a = await worker.submit(request(3), time.perf_counter())  # step 1 starts and waits at the gate
            reading = [asyncio.ensure_future(read(a, "a", log))]
            b = asyncio.ensure_future(worker.submit(request(1), time.perf_counter()))
            await asyncio.sleep(0)  # b's submit is on the command queue while step 1 runs
            engine.gate.release()
            reading.append(asyncio.ensure_future(read(await b, "b", log)))  # step 2 waits at the gate
            await asyncio.sleep(0)  # both readers wait for their streams
            engine.gate.release()
            engine.gate.release()
            await asyncio.gather(*reading)
        finally:
            await asyncio.to_thread(worker.stop)

    asyncio.run(main())
    a_id, b_id = engine.steps[0][0], engine.steps[1][1]
    assert engine.steps == [[a_id], [a_id, b_id], [a_id]]  # b joined the step after the one it was posted in
    # step 2 emitted a's second token before b's first, but b's reader (a client waiting for its
    # first token) ran first
    assert log == [("a", 1), ("b", 1), ("a", 2), ("a", 3)]


def test_workers_whose_lifetimes_overlap_restore_the_interpreters_switch_interval_when_the_last_stops():
    before = sys.getswitchinterval()

    async def main() -> list[float]:
        a = await started(GatedEngine())
        b = await started(GatedEngine())
        seen = []
        await asyncio.to_thread(a.stop)  # stopped first, started first: b still runs
        seen.append(sys.getswitchinterval())
        with pytest.raises(RuntimeError):
            b.start(asyncio.get_running_loop())  # a thread starts once; the interval stays b's
        seen.append(sys.getswitchinterval())
        await asyncio.to_thread(b.stop)
        return seen

    assert asyncio.run(main()) == [pytest.approx(worker_module.SWITCH_INTERVAL_S)] * 2
    assert sys.getswitchinterval() == before


class Broken(RuntimeError):
    pass


def test_an_error_outside_a_step_ends_the_thread_but_fails_every_stream_and_queued_submit():
    # the engine thread ends on an error of its own (here: recording a first token); the streams it
    # served get the error instead of waiting forever, a submit it never took is answered 503, and the
    # switch interval is restored without waiting for stop
    before = sys.getswitchinterval()
    engine = GatedEngine(gated=True)

    async def main() -> None:
        worker = await started(engine)
        metrics = worker.metrics

        def observe(seconds: float) -> None:
            raise Broken("the histogram failed")

        metrics.ttft.observe = observe
        try:
            a = await worker.submit(request(3), time.perf_counter())  # step 1 waits at the gate
            b = asyncio.ensure_future(worker.submit(request(1), time.perf_counter()))
            await asyncio.sleep(0)  # b is queued behind step 1
            engine.gate.release()  # step 1's delivery raises: the thread ends
            with pytest.raises(Broken):
                await read(a, "a", [])
            with pytest.raises(APIError) as refused:
                await b
            assert refused.value.status == 503
            await asyncio.to_thread(worker._thread.join)
            assert not worker.alive and sys.getswitchinterval() == before
            with pytest.raises(APIError):  # posted after the thread ended: answered at once
                await worker.submit(request(1), time.perf_counter())
        finally:
            await asyncio.to_thread(worker.stop)

    asyncio.run(asyncio.wait_for(main(), 60))  # a hang fails the test instead of the suite
    assert sys.getswitchinterval() == before


def test_a_failed_step_fails_its_streams_and_the_thread_serves_on_unless_the_engine_cannot_step_again():
    # a step's error reaches the streams it served; the next request is served, but after a
    # TensorParallelError (a rank failed: the engine's processes are stopped) the thread ends, so
    # /health reports it and submits are answered 503 instead of failing one step at a time
    errors = [RuntimeError("a step failed"), None, None, TensorParallelError("rank 1 raised RuntimeError")]

    def on_step() -> None:
        error = errors.pop(0) if errors else None
        if error is not None:
            raise error

    engine = GatedEngine(on_step)

    async def main() -> None:
        worker = await started(engine)
        try:
            with pytest.raises(RuntimeError, match="a step failed"):
                await read(await worker.submit(request(1), time.perf_counter()), "a", [])
            log: list = []
            await read(await worker.submit(request(2), time.perf_counter()), "b", log)
            assert log[-1] == ("b", 2) and worker.alive
            with pytest.raises(TensorParallelError):
                await read(await worker.submit(request(1), time.perf_counter()), "c", [])
            await asyncio.to_thread(worker._thread.join, 10.0)
            assert not worker.alive
            with pytest.raises(APIError) as refused:
                await worker.submit(request(1), time.perf_counter())
            assert refused.value.status == 503
        finally:
            await asyncio.to_thread(worker.stop)

    asyncio.run(asyncio.wait_for(main(), 60))  # a hang fails the test instead of the suite


def test_a_submit_queued_behind_stop_is_answered_503():
    engine = GatedEngine(gated=True)

    async def main() -> None:
        worker = await started(engine)
        try:
            await worker.submit(request(3), time.perf_counter())  # step 1 waits at the gate
            worker.post(("stop",))
            late = asyncio.ensure_future(worker.submit(request(1), time.perf_counter()))
            await asyncio.sleep(0)  # queued behind the stop: both are taken after step 1
            engine.gate.release()
            with pytest.raises(APIError) as refused:
                await late
            assert refused.value.status == 503
        finally:
            await asyncio.to_thread(worker.stop)

    asyncio.run(asyncio.wait_for(main(), 60))  # a hang fails the test instead of the suite


def test_deadlines_come_due_in_order_and_those_of_finished_requests_do_not_pile_up():
    deadlines = Deadlines()
    for rid in range(5000):
        deadlines.add(rid, at=1000.0 + rid)
    live = {4998, 4999}
    assert deadlines.due(0.0, live) == [] and len(deadlines._heap) == 2  # pruned to the live ones
    deadlines.add(7, at=5.0)
    assert deadlines.due(6000.0, {7, 4999}) == [7, 4999]


def test_an_engine_thread_that_fails_while_taking_a_submit_answers_it_500_instead_of_leaving_it_waiting():
    class Failing(GatedEngine):
        @property
        def cached_columns(self) -> int:  # read when the thread counts the new request
            raise Broken("the engine state could not be read")

    engine = Failing()

    async def main() -> None:
        worker = await started(engine)
        try:
            with pytest.raises(APIError) as failed:
                await asyncio.wait_for(worker.submit(request(2), time.perf_counter()), 30)
            assert failed.value.status == 500 and "Broken" not in str(failed.value)  # no internals in the body
            await asyncio.to_thread(worker._thread.join, 30)
            assert not worker.alive
            with pytest.raises(APIError) as later:  # the thread has ended: answered 503 at once
                await asyncio.wait_for(worker.submit(request(1), time.perf_counter()), 30)
            assert later.value.status == 503
        finally:
            await asyncio.to_thread(worker.stop)

    asyncio.run(main())
