"""The server's engine half in a process of its own (`process.ProcessWorker` starts it): commands in,
one message per step out.

`EngineCore` owns the `Engine`. It takes the API process's commands between steps, as the engine
thread does (submit, cancel, drain, compile, stop), steps while any request is live and blocks on
the pipe when none is, ends requests past their time and, once draining, refuses submits and
cancels what is still live at the deadline. Each step becomes one message: the events (request ids,
tokens, finishes, samples, logprobs), the prompt tokens each newly admitted request
reused from the prefix cache, and the state gauges the metrics need. The front half (routing,
trackers, wakes, metrics) runs in the API process (`front.Front`).

Messages, engine -> API (msgpack through msgspec, one `send_bytes` each; the first item names it):
- `["a", key, ids | None, error | None, gauges]`: a submit's answer (the engine's ids, or why not);
- `["s", gauges, cached, events, t]`: a step (`events` msgpack of the engine's `Event`s, `encode_events`;
  `t` its end on this process's `perf_counter`, which spaces the steps an API reader feeds together);
- `["d", ids]`: requests cancelled by a command (their events go nowhere);
- `["x", ids]`: requests past their time, cancelled (their "cancelled" events mean "timeout");
- `["f"]`: a step failed; every live request was cancelled;
- `["i", gauges]`: nothing to step;
- `["c", token, error | None]`: a constraint compiled (on a thread of this process);
- `["e", text]`: the core failed and ends.
Commands, API -> engine, are pickled tuples (a submit carries its `Request`s): `("submit", key,
requests, arrival)`, `("cancel", key, prompt_index | None)`, `("drain", seconds)`, `("compile",
token, constraint)`, `("stop",)`. Times are `time.perf_counter`'s, one clock for both processes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec

from batchkv.errors import RequestError, TensorParallelError
from batchkv.executor import Event, Request
from batchkv.serve import structured
from batchkv.serve.front import refusal
from batchkv.serve.protocol import APIError
from batchkv.serve.stream import Deadlines

log = logging.getLogger("batchkv.serve")
_EVENTS_ENCODE = msgspec.msgpack.Encoder().encode
_EVENTS_DECODE = msgspec.msgpack.Decoder(list[Event]).decode
TRIM_STEPS = 4096  # the engine's own latency lists are cleared this often (they grow per step)


def error_fields(error: APIError) -> list:
    """An APIError as a message's list (`api_error` rebuilds it)."""
    return [error.status, error.message, error.type, error.param, error.code]


def api_error(fields: list) -> APIError:
    status, message, type_, param, code = fields
    return APIError(status, message, type=type_, param=param, code=code)


def gauges(engine: Any) -> list:
    """What `ServerMetrics.observe_engine` takes, in its order (`observe`)."""
    cached = engine.cached_columns
    return [engine.num_running, engine.num_waiting, len(engine.cache.sequences) - cached, cached,
            engine.runner.captures, list(engine.kv_usage)]  # fmt: skip


def observe(metrics: Any, values: list) -> None:
    running, waiting, columns, cached, captures, positions = values
    metrics.observe_engine(running=running, waiting=waiting, columns=columns, cached=cached, captures=captures,
                           positions=tuple(positions))  # fmt: skip


def encode_events(events: list[Event]) -> bytes:
    """A step's events as msgpack (msgspec encodes the dataclasses natively: 55 us for 256 events
    on this CPU, against 77 for the same as columns, and decoding makes the `Event`s in C)."""
    return _EVENTS_ENCODE(events)


def decode_events(data: bytes) -> list[Event]:
    """`encode_events`' bytes back as `Event`s, equal to the engine's."""
    return _EVENTS_DECODE(data)


class EngineCore:
    """Runs `engine` for the API process: `serve(receive)` until a stop command or the pipe closes.
    `send(message)` takes one message list (thread-safe: compiles answer from a thread);
    `receive(timeout)` returns the next command, None once `timeout` seconds pass (None: block),
    and raises EOFError when the API process is gone; `ready()` says whether a command waits."""

    def __init__(self, engine: Any, send: Callable[[list], None], *, max_waiting: int,
                 request_timeout: float | None = None) -> None:  # fmt: skip
        self.engine, self.send, self.max_waiting, self.request_timeout = engine, send, max_waiting, request_timeout
        self._left: dict[int, int] = {}  # live engine request id -> its samples not yet finished
        self._owner: dict[int, int] = {}  # live engine request id -> its stream's key
        self._keys: dict[int, list[int]] = {}  # stream key -> its engine request ids, by prompt index
        self._uncached: set[int] = set()  # admitted ids whose reused prompt tokens are not yet said
        self._expiry = Deadlines()
        self._deadline: float | None = None  # draining: cancel what is live at this monotonic time
        self._steps = 0
        self._compiler = ThreadPoolExecutor(1, thread_name_prefix="batchkv-compile")

    def serve(self, receive: Callable[[float | None], tuple | None], ready: Callable[[], bool]) -> None:
        engine = self.engine
        try:
            while True:
                commands = [] if engine.has_work else [receive(self._wait())]
                while ready():
                    commands.append(receive(None))
                for command in commands:
                    if command is None:
                        continue
                    if command[0] == "stop":
                        self._cancel_all()
                        return
                    getattr(self, "_" + command[0])(*command[1:])
                if self._deadline is not None and time.monotonic() >= self._deadline:
                    for rid in list(self._left):  # ids stay: the "cancelled" events end the streams
                        engine.cancel(rid)
                self._expire()
                if engine.has_work:
                    self._step()
                else:
                    self.send(["i", gauges(engine)])
        finally:
            self._compiler.shutdown(wait=False, cancel_futures=True)

    def _wait(self) -> float | None:
        """How long an idle core waits for a command: until the drain deadline, then (its cancels made)
        for good: an idle core past its deadline blocks instead of spinning on idle messages."""
        left = None if self._deadline is None else self._deadline - time.monotonic()
        return left if left is not None and left > 0 else None

    def _drain(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        if self._deadline is None or deadline < self._deadline:
            self._deadline = deadline

    def _expire(self) -> None:
        due = self._expiry.due(time.perf_counter(), self._left.keys())
        if due:
            self.send(["x", due])  # before the "cancelled" events: the front reads them as "timeout"
            for rid in due:
                self.engine.cancel(rid)

    def _submit(self, key: int, requests: list[Request], arrival: float) -> None:
        engine = self.engine
        error = refusal(self._deadline is not None, engine.num_waiting, len(requests), self.max_waiting)
        if error is not None:
            self.send(["a", key, None, error_fields(error), None])
            return
        ids: list[int] = []
        try:
            for request in requests:
                ids.append(engine.submit(request))
        except RequestError as exc:
            for rid in ids:
                engine.cancel(rid)
            self.send(["a", key, None, error_fields(APIError(400, str(exc))), None])
            return
        except Exception:  # the core ends (`serve` raises); this submit gets a 500, not a wait
            failed = APIError(500, "the engine process failed; the server log has the detail", type="server_error")
            self.send(["a", key, None, error_fields(failed), None])
            raise
        self._keys[key] = ids
        for rid, request in zip(ids, requests, strict=True):
            self._left[rid], self._owner[rid] = request.params.n, key
            if self.request_timeout is not None:
                self._expiry.add(rid, arrival + self.request_timeout)
        self._uncached.update(ids)
        self.send(["a", key, ids, None, gauges(engine)])

    def _cancel(self, key: int, prompt_index: int | None) -> None:
        ids = self._keys.get(key, [])
        chosen = [rid for index, rid in enumerate(ids) if prompt_index is None or index == prompt_index]
        chosen = [rid for rid in chosen if rid in self._left]
        for rid in chosen:
            self.engine.cancel(rid)
            self._forget(rid)
        if chosen:
            self.send(["d", chosen])

    def _cancel_all(self) -> None:
        for rid in list(self._left):
            self.engine.cancel(rid)
            self._forget(rid)

    def _forget(self, rid: int) -> None:
        del self._left[rid]
        self._uncached.discard(rid)
        key = self._owner.pop(rid)
        if not any(other in self._left for other in self._keys.get(key, ())):
            self._keys.pop(key, None)

    def _compile(self, token: int, constraint: Any) -> None:
        """Compile on a thread of this process (xgrammar's compile may take a while): steps go on."""

        def work() -> None:
            try:
                structured.compile_constraint(self.engine, constraint)
                self.send(["c", token, None])
            except APIError as exc:
                self.send(["c", token, error_fields(exc)])
            except Exception:
                log.exception("compiling a constraint failed")
                self.send(["c", token, error_fields(APIError(500, "compiling the constraint failed"))])

        self._compiler.submit(work)

    def _step(self) -> None:
        engine = self.engine
        try:
            events = engine.step()
        except TensorParallelError:  # no later step can run: the core ends
            raise
        except Exception:  # a failed step: every live request sees it
            log.exception("engine step failed; failing %d live requests", len(self._left))
            self._cancel_all()
            self.send(["f"])
            return
        self._steps += 1
        if self._steps % TRIM_STEPS == 0:
            m = engine.metrics
            m.step_times.clear(), m.inter_token.clear(), m.first_token.clear()
        cached = self._cached(events)
        for event in events:
            if event.finish_reason is not None and event.request_id in self._left:
                self._left[event.request_id] -= 1
                if self._left[event.request_id] == 0:
                    self._forget(event.request_id)
        self.send(["s", gauges(engine), cached, encode_events(events), time.perf_counter()])

    def _cached(self, events: list[Event]) -> list[list[int]]:
        """[id, tokens] for the requests of `events` whose reused prompt tokens are now known."""
        if not self._uncached:
            return []
        out = []
        for rid in {e.request_id for e in events if e.request_id in self._uncached}:
            tokens = self.engine.cached_tokens(rid)
            if tokens is not None:
                out.append([rid, tokens])
                self._uncached.discard(rid)
        return out


class Sender:
    """`EngineCore.send` over a `multiprocessing` connection: msgpack, one `send_bytes`, under a lock
    (the compile thread sends too)."""

    def __init__(self, conn: Any) -> None:
        self.conn, self.encode, self.lock = conn, msgspec.msgpack.Encoder().encode, threading.Lock()

    def __call__(self, message: list) -> None:
        with self.lock:
            self.conn.send_bytes(self.encode(message))
