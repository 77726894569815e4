"""The engine thread: the only code that touches the `Engine` once the server runs.

HTTP handlers (on the asyncio loop) never call the engine. They post commands to a thread-safe
queue: submit (answered through an asyncio future) and cancel. The thread applies the commands
between steps, steps while any request is live (and blocks on the queue when none is), and hands
each step's events to the loop in one `call_soon_threadsafe`, which puts them on the per-request
asyncio queues. A step that raises fails every live request (they see the exception) and the
thread goes on serving.

Latency. The two threads share the GIL, and the engine thread holds it while it plans a step (a
few ms of Python). So that planning does not sit on the HTTP path:
- Tokens go out before the next plan: an overlapping engine (whose next step is already queued on
  the device while the host plans) waits, at most `HANDOFF_S`, until the loop has run the readers
  a step's events woke, i.e. written their chunks to the sockets. Without the wait the loop thread,
  woken by `call_soon_threadsafe`, queued for the GIL behind the whole plan (up to 3 ms of host
  time per step at 64 sequences on the H200: bench/results/serve-profile-h200.json, overlap off).
  A non-overlapping engine does not wait: its device idles while the host plans, and the loop's
  writes run in the GIL-free device wait that follows.
- Streams that get a first token are handed to the loop before the others, so the readers the
  loop runs first (it runs them in order) are the ones whose client still waits for a first token.
- While the engine thread runs, the interpreter's switch interval is `SWITCH_INTERVAL_S` (CPython's
  default is 5 ms), so a request that arrives while a step is planned waits at most that long for
  the GIL at each hop (accept, parse, post) instead of up to the whole plan; it is restored when
  the thread ends (`ShortSwitch`: workers whose lifetimes overlap restore it when the last ends).

Shutdown: `drain(seconds)` (safe to call from a signal handler) refuses new submits with 503 and,
once the seconds pass, cancels every live request; each stream then ends with its samples'
"cancelled" events, so handlers finish normally instead of being torn down. An error outside a
step (a failed step is survived) ends the thread: every live stream gets it, and submits the thread
did not take are answered 503, so no handler waits on a thread that is gone.

A `Stream` is one HTTP request's view: it may hold several engine requests (a batch of prompts),
each with n samples; items on its queue are lists of `(prompt_index, Event)`, or an exception.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from batchkv.errors import RequestError
from batchkv.executor import Engine, Event, Request
from batchkv.serve.metrics import ServerMetrics
from batchkv.serve.protocol import APIError
from batchkv.serve.switch import ShortSwitch

log = logging.getLogger("batchkv.serve")
TRIM_STEPS = 4096  # the engine's own latency lists are cleared this often (they grow per step)
SWITCH_INTERVAL_S = 0.0005  # sys.setswitchinterval while the engine thread runs (CPython's default: 0.005)
HANDOFF_S = 0.002  # most an overlapping engine waits, per step, for the loop to write that step's tokens


class Stream:
    """Events of one HTTP request's engine requests, delivered on the asyncio loop."""

    def __init__(self, worker: EngineWorker) -> None:
        self.worker = worker
        self.queue: asyncio.Queue[list[tuple[int, Event]] | BaseException] = asyncio.Queue()
        self.ids: list[int] = []  # engine request ids, by prompt index (engine thread only)

    def __aiter__(self) -> AsyncIterator[list[tuple[int, Event]]]:
        return self._items()

    async def _items(self) -> AsyncIterator[list[tuple[int, Event]]]:
        """Everything queued so far, as one list: a reader that falls behind catches up in one go."""
        while True:
            items = [await self.queue.get()]
            while not self.queue.empty():
                items.append(self.queue.get_nowait())
            for item in items:
                if isinstance(item, BaseException):
                    raise item
            yield [event for item in items for event in item]  # type: ignore[union-attr]

    def cancel(self, prompt_index: int | None = None) -> None:
        """Cancel one prompt's engine request, or all of them; frees their columns (thread-safe)."""
        self.worker.post(("cancel", self, prompt_index))


@dataclass(eq=False)
class _Route:
    stream: Stream
    prompt_index: int
    samples: int
    arrival: float
    last: dict[int, float] = field(default_factory=dict)  # sample -> time of its last token
    finished: int = 0


class EngineWorker:
    """Owns `engine` on a thread of its own. `max_waiting`: most requests queued for columns."""

    def __init__(self, engine: Engine, metrics: ServerMetrics, *, max_waiting: int) -> None:
        self.engine, self.metrics, self.max_waiting = engine, metrics, max_waiting
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._routes: dict[int, _Route] = {}  # engine request id -> where its events go
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="batchkv-engine", daemon=True)
        self._steps = 0
        self._deadline: float | None = None  # draining: cancel what is live at this monotonic time
        self._handoff = bool(engine.overlap)  # wait for the loop's writes after each step (see above)
        self._switch = ShortSwitch(SWITCH_INTERVAL_S)  # held from start until the thread ends
        self._ended = False  # the thread is past its last command: `submit` answers for it

    # ---- loop side -----------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the engine thread (once per worker); events are delivered on `loop`. The switch
        interval is `SWITCH_INTERVAL_S` until the thread ends."""
        if self._thread.ident is not None:
            raise RuntimeError("an EngineWorker's thread starts once; build another worker to serve again")
        self._loop = loop
        self._switch.hold()
        try:
            self._thread.start()
        except BaseException:
            self._switch.release()
            raise

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel whatever is live, end the thread and restore the switch interval (also when the
        thread outlives `timeout`)."""
        if self._thread.is_alive():
            self.post(("stop",))
            self._thread.join(timeout)
        self._switch.release()

    def drain(self, seconds: float) -> None:
        """Stop taking requests; cancel those still live after `seconds`. Signal-handler safe."""
        self.post(("drain", time.monotonic() + seconds))

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def post(self, command: tuple) -> None:
        """Queue a command for the engine thread (any thread; signal-handler safe)."""
        self._commands.put(command)

    async def submit(self, requests: Sequence[Request], arrival: float) -> Stream:
        """Queue engine requests as one stream. APIError 429 when the waiting queue is full, 400
        when the engine refuses one (then none of them is queued)."""
        loop = asyncio.get_running_loop()
        stream, done = Stream(self), loop.create_future()
        self.post(("submit", stream, list(requests), arrival, done))
        if self._ended:  # set before the thread empties its queue: this submit may have missed that
            self._resolve(done, _ended_error())
        try:
            await done
        except asyncio.CancelledError:
            stream.cancel()  # runs after the submit: the queue is FIFO
            raise
        return stream

    def _call(self, fn, *args) -> None:
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody is listening
            self._loop.call_soon_threadsafe(fn, *args)

    @staticmethod
    def _resolve(future: asyncio.Future, error: BaseException | None) -> None:
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(None)

    @staticmethod
    def _dispatch(deliveries: dict[Stream, list], written: threading.Event | None = None) -> None:
        for stream, items in deliveries.items():
            stream.queue.put_nowait(items)
        if written is not None:  # callbacks run in order: the readers woken above write their chunks first
            asyncio.get_running_loop().call_soon(written.set)

    # ---- engine thread -------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._serve()
        except Exception as exc:  # outside a step (`_step` survives a failed one): the thread ends
            log.exception("the engine thread failed; failing %d live requests", len(self._routes))
            streams = {route.stream for route in self._routes.values()}
            self._routes.clear()
            self._call(self._dispatch, dict.fromkeys(streams, exc))
        finally:
            self._ended = True  # before the queue is emptied (see `submit`)
            while not self._commands.empty():  # this thread is its only reader
                self._refuse([self._commands.get_nowait()])
            self._switch.release()

    def _refuse(self, commands: list[tuple]) -> None:
        """Answer the submits among commands the thread will not apply: 503."""
        for command in commands:
            if command[0] == "submit":
                self._call(self._resolve, command[-1], _ended_error())

    def _serve(self) -> None:
        engine = self.engine
        while True:
            commands = [] if engine.has_work else [self._next_command()]
            while True:
                try:
                    commands.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            for i, command in enumerate(commands):
                if command[0] == "stop":
                    self._cancel_all()
                    self._refuse(commands[i + 1 :])
                    return
                getattr(self, "_" + command[0])(*command[1:])
            if self._deadline is not None and time.monotonic() >= self._deadline:
                for rid in list(self._routes):  # routes stay: the "cancelled" events end the streams
                    engine.cancel(rid)
            if engine.has_work:
                self._step()
            else:
                self._observe()

    def _next_command(self) -> tuple:
        """Block for a command; while draining, only until the deadline (then a no-op)."""
        if self._deadline is None:
            return self._commands.get()
        try:
            return self._commands.get(timeout=max(self._deadline - time.monotonic(), 0.0))
        except queue.Empty:
            return ("idle",)

    def _idle(self) -> None:
        pass

    def _drain(self, deadline: float) -> None:
        if self._deadline is None or deadline < self._deadline:
            self._deadline = deadline

    def _submit(self, stream: Stream, requests: list[Request], arrival: float, done: asyncio.Future) -> None:
        engine = self.engine
        if self._deadline is not None:
            error = APIError(503, "the server is shutting down; retry on another replica", type="server_error")
            self._call(self._resolve, done, error)
            return
        if engine.num_waiting + len(requests) > self.max_waiting:
            error = APIError(
                429,
                f"the server is busy: {engine.num_waiting} requests are waiting for columns and the queue holds "
                f"{self.max_waiting} (retry later; the server's --max-waiting sets the queue)",
                type="rate_limit_error",
                code="queue_full",
            )
            self._call(self._resolve, done, error)
            return
        try:
            for index, request in enumerate(requests):
                rid = engine.submit(request)
                stream.ids.append(rid)
                self._routes[rid] = _Route(stream, index, request.params.n, arrival)
        except RequestError as exc:
            self._cancel(stream, None)
            self._call(self._resolve, done, APIError(400, str(exc)))
            return
        self.metrics.prompted.inc(sum(len(r.prompt_ids) for r in requests))
        self._observe()  # before the answer: a client that got its 200 sees itself counted
        self._call(self._resolve, done, None)

    def _cancel(self, stream: Stream, prompt_index: int | None) -> None:
        for index, rid in enumerate(stream.ids):
            if prompt_index is None or index == prompt_index:
                self.engine.cancel(rid)
                self._routes.pop(rid, None)  # its "cancelled" events go nowhere

    def _cancel_all(self) -> None:
        for rid in list(self._routes):
            self.engine.cancel(rid)
        self._routes.clear()

    def _step(self) -> None:
        try:
            events = self.engine.step()
        except Exception as exc:  # a failed step: every live request sees the error
            log.exception("engine step failed; failing %d live requests", len(self._routes))
            streams = {route.stream for route in self._routes.values()}
            self._cancel_all()
            self._call(self._dispatch, dict.fromkeys(streams, exc))
            return
        self._steps += 1
        if self._steps % TRIM_STEPS == 0:
            m = self.engine.metrics
            m.step_times.clear(), m.inter_token.clear(), m.first_token.clear()
        self._observe()  # before the tokens go out: a client that saw them sees this step's state
        self._deliver(events)

    def _deliver(self, events: list[Event]) -> None:
        now = time.perf_counter()
        deliveries: dict[Stream, list] = {}
        firsts: dict[Stream, None] = {}  # streams with a sample's first token, in event order
        for event in events:
            if event.finish_reason is not None:
                self.metrics.finished.labels(event.finish_reason).inc()
            route = self._routes.get(event.request_id)
            if route is None:
                continue
            if event.token is not None:
                self.metrics.generated.inc()
                last = route.last.get(event.sample)
                if last is None:
                    self.metrics.ttft.observe(now - route.arrival)
                    firsts[route.stream] = None
                elif last != now:  # tokens accepted in one verify step arrive together: one gap, not zeros
                    self.metrics.itl.observe(now - last)
                route.last[event.sample] = now
            if event.finish_reason is not None:
                route.finished += 1
                if route.finished == route.samples:
                    del self._routes[event.request_id]
            deliveries.setdefault(route.stream, []).append((route.prompt_index, event))
        if deliveries:
            # Readers run in this order: first tokens (a client waiting out its TTFT) before the rest.
            deliveries = {stream: deliveries[stream] for stream in firsts} | deliveries
            written = threading.Event()
            self._call(self._dispatch, deliveries, written)
            if self._handoff:
                written.wait(HANDOFF_S)  # GIL released: the loop writes while the device runs the next step

    def _observe(self) -> None:
        engine = self.engine
        self.metrics.observe_engine(
            running=engine.num_running,
            waiting=engine.num_waiting,
            columns=len(engine.cache.sequences),
            captures=engine.runner.captures,
        )


def _ended_error() -> APIError:
    return APIError(503, "the engine thread has stopped", type="server_error")
