"""The engine in a process of its own (`batchkv.serve.process`): the same answers as the engine
thread, failures that end the streams and answer 503, startup errors with their own type, and no
engine process left behind. A counting engine in a spawned process first (no model), then
`batchkv serve --engine-process on` over the tiny Qwen3 with the official `openai` client and
transformers' `generate` as the oracle."""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from batchkv.errors import CapacityError, EngineProcessError
from batchkv.executor import Event, Request, SamplingParams
from batchkv.executor.request import Logprobs
from batchkv.serve.core import decode_events, encode_events
from batchkv.serve.metrics import ServerMetrics
from batchkv.serve.process import ProcessWorker
from batchkv.serve.protocol import APIError
from batchkv.serve.worker import EngineWorker


class CountingEngine:
    """Token 7 for every live sample each step (`sleep_s` a step), finishing at max_new_tokens;
    a cancel ends the request's samples with "cancelled" events at the next step; the steps whose
    number is in `fail_at` raise."""

    overlap = False
    cached_columns = 0
    kv_usage = (0, 64)
    grammars = None

    def __init__(self, sleep_s: float = 0.0, fail_at: tuple[int, ...] = ()) -> None:
        self.sleep_s, self.fail_at, self.steps = sleep_s, fail_at, 0
        self.left: dict[int, list[int]] = {}  # request id -> tokens still to emit, per sample
        self.cancelled: list[int] = []
        self.next_id = 0
        self.cache = SimpleNamespace(sequences=[])
        self.runner = SimpleNamespace(captures=0)
        self.metrics = SimpleNamespace(step_times=[], inter_token=[], first_token=[])
        self.num_waiting = 0

    has_work = property(lambda self: bool(self.left or self.cancelled))
    num_running = property(lambda self: len(self.left))

    def submit(self, request: Request) -> int:
        self.next_id += 1
        self.left[self.next_id] = [request.params.max_new_tokens] * request.params.n
        return self.next_id

    def cancel(self, rid: int) -> bool:
        if rid in self.left:
            self.cancelled.append(rid)
        return rid in self.left

    def cached_tokens(self, rid: int) -> int | None:
        return 0 if rid in self.left else None

    def step(self) -> list[Event]:
        self.steps += 1
        time.sleep(self.sleep_s)
        if self.steps in self.fail_at:
            raise RuntimeError("a step failed")
        events = []
        for rid in self.cancelled:
            events += [Event(rid, None, "cancelled", s) for s, n in enumerate(self.left.pop(rid, [])) if n > 0]
        self.cancelled = []
        for rid, left in list(self.left.items()):
            for s, n in enumerate(left):
                if n > 0:
                    left[s] -= 1
                    events.append(Event(rid, 7, "length" if n == 1 else None, s))
            if not any(left):
                del self.left[rid]
        return events

    def close(self) -> None:
        pass


def counting(sleep_s: float = 0.0, fail_at: tuple[int, ...] = ()) -> tuple[CountingEngine, str]:
    """The engine process's factory (picklable: this module's function)."""
    return CountingEngine(sleep_s, fail_at), "counting"


def refusing() -> tuple:
    raise CapacityError("the store needs 9 GiB and the device has 1 (lower --max-seqs)")


def exiting() -> tuple:
    os._exit(3)


def request(tokens: int, n: int = 1) -> list[Request]:
    return [Request([1, 2], SamplingParams(max_new_tokens=tokens, n=n))]


async def events_of(stream) -> list[tuple[int, Event]]:
    """Every item until each sample finished (bounded by the stream's own finishes)."""
    out: list = []
    async for items in stream:
        out += items
        finishes = sum(event.finish_reason is not None for _, event in out)
        if (
            finishes
            and finishes == sum(1 for _, e in out if e.token is None or e.finish_reason)
            and all(any(e.finish_reason for _, e in out if e.sample == s) for s in {e.sample for _, e in out})
        ):
            return out
    return out


async def launched(factory, **kw) -> ProcessWorker:
    worker = ProcessWorker(factory, max_waiting=8, **kw)
    assert await asyncio.to_thread(worker.launch) == "counting"
    worker.metrics = ServerMetrics(4)
    worker.start(asyncio.get_running_loop())
    return worker


def gone(pid: int) -> bool:
    return not Path(f"/proc/{pid}").exists()


def test_a_steps_events_cross_the_pipe_as_the_engine_made_them():
    lp = Logprobs(5, -0.25, ((5, -0.25), (9, -1.5)))
    made = [Event(3, 11), Event(4, 12, "length", 1, lp), Event(5, None, "cancelled", 0),
            Event(6, 13, None, 0, None, (None, lp))]  # fmt: skip
    assert decode_events(*encode_events(made)) == made
    assert decode_events(*encode_events(made[:1])) == made[:1]  # no logprobs at all: a None column


def test_the_engine_process_answers_as_the_engine_thread_then_drains_and_stops_leaving_no_process():
    async def serve(worker) -> list:
        a = asyncio.ensure_future(events_of(await worker.submit(request(3), time.perf_counter())))
        b = asyncio.ensure_future(events_of(await worker.submit(request(2, n=2), time.perf_counter())))
        return [[(i, e.token, e.finish_reason, e.sample) for i, e in await x] for x in (a, b)]

    async def main() -> tuple[list, list]:
        thread = EngineWorker(CountingEngine(), ServerMetrics(4), max_waiting=8)  # type: ignore[arg-type]
        thread.start(asyncio.get_running_loop())
        try:
            expected = await serve(thread)
        finally:
            await asyncio.to_thread(thread.stop)
        worker = await launched(functools.partial(counting, 0.005))
        pid = worker.process.pid
        try:
            got = await serve(worker)
            long = await worker.submit(request(10_000), time.perf_counter())
            worker.drain(0.2)  # the live request is cancelled at the deadline; new submits are refused
            ended = await asyncio.wait_for(events_of(long), 30)
            assert ended[-1][1].finish_reason == "cancelled"
            with pytest.raises(APIError) as refused:
                await worker.submit(request(1), time.perf_counter())
            assert refused.value.status == 503
            assert worker.alive
        finally:
            await asyncio.to_thread(worker.stop)
        assert not worker.alive and gone(pid)
        return expected, got

    expected, got = asyncio.run(asyncio.wait_for(main(), 120))
    assert got == expected and [len(x) for x in got] == [3, 4]


def test_a_failed_step_fails_its_streams_and_a_killed_engine_process_fails_them_and_answers_503():
    async def main() -> None:
        worker = await launched(functools.partial(counting, 0.01, (2,)))
        pid = worker.process.pid
        try:
            with pytest.raises(EngineProcessError, match="step failed"):
                await events_of(await worker.submit(request(5), time.perf_counter()))
            served = await events_of(await worker.submit(request(2), time.perf_counter()))
            assert [e.token for _, e in served] == [7, 7] and worker.alive  # it serves on
            live = await worker.submit(request(100_000), time.perf_counter())
            async for _ in live:  # a first token: the request is running
                break
            os.kill(pid, signal.SIGKILL)
            with pytest.raises(EngineProcessError):
                await asyncio.wait_for(events_of(live), 30)
            with pytest.raises(APIError) as refused:
                await worker.submit(request(1), time.perf_counter())
            assert refused.value.status == 503 and not worker.alive
        finally:
            await asyncio.to_thread(worker.stop)
        assert gone(pid)

    asyncio.run(asyncio.wait_for(main(), 120))


def test_a_startup_error_in_the_engine_process_is_raised_with_its_type_and_the_process_is_gone():
    worker = ProcessWorker(refusing, max_waiting=8)
    with pytest.raises(CapacityError, match="lower --max-seqs"):
        worker.launch()
    assert not worker.process.is_alive()
    worker.stop()  # after a failed launch: nothing to do, and no error
    dying = ProcessWorker(exiting, max_waiting=8)
    with pytest.raises(EngineProcessError, match="status 3"):
        dying.launch()
