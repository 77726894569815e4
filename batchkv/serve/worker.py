"""The engine thread: the only code that touches the `Engine` once the server runs.

HTTP handlers (on the asyncio loop) never call the engine. They post commands to a thread-safe
queue: submit (answered through an asyncio future) and cancel. The thread applies the commands
between steps, steps while any request is live (and blocks on the queue when none is), and hands
each step's events to the loop in one `call_soon_threadsafe`, which puts them on the per-request
asyncio queues. A stream submitted with its `Tracker` gets no events: this thread feeds the
tracker (detokenising, stop strings, finishes; `_feed`) and the loop gets only wakes, at most
`WAKES_PER_STEP` a step for deltas that are neither a stream's first nor a finish (docs/design.md,
"HTTP server"). A step that raises fails every live request (they see the exception) and the
thread goes on serving, unless the engine cannot step again (`TensorParallelError`: a rank failed
and the engine's processes are stopped): the thread then ends, as on an error outside a step.

Latency (measured and explained in docs/design.md, "HTTP server"). The two threads share the GIL,
and the engine thread holds it while it plans a step. So that planning does not sit on the HTTP
path: an overlapping engine waits after each step, at most `HANDOFF_S`, until the loop has run the
readers the step's events woke (their chunks are in the sockets); a non-overlapping engine does
not wait (its device idles while the host plans, and the loop writes in the device wait). Streams
that get a first token are handed over first. While the thread runs, the interpreter's switch
interval is `SWITCH_INTERVAL_S` (CPython's default is 5 ms), restored when it ends (`ShortSwitch`).

Shutdown: `drain(seconds)` (safe to call from a signal handler) refuses new submits with 503 and,
once the seconds pass, cancels every live request; each stream then ends with its samples'
"cancelled" events, so handlers finish normally instead of being torn down. An error outside a
step (a failed step is survived) ends the thread: every live stream gets it, and submits the thread
did not take are answered 503, so no handler waits on a thread that is gone.

Request time: with `request_timeout`, a request still live that many seconds after it arrived is
cancelled between steps, waiting or running; its samples end with finish reason "timeout" and its
columns are free for the next step. A batch of more prompts than `max_waiting` could never be
queued: `refuse_batch` answers it 400, never a 429 a client would retry forever.

`Stream`, `Route` and `Deadlines` live in `stream`.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Sequence

from batchkv.errors import RequestError, TensorParallelError
from batchkv.executor import Engine, Event, Request
from batchkv.serve import structured
from batchkv.serve.front import Front, refusal
from batchkv.serve.metrics import ServerMetrics
from batchkv.serve.outputs import Tracker
from batchkv.serve.protocol import APIError
from batchkv.serve.stream import Deadlines, Route, Stream, route_events
from batchkv.serve.switch import ShortSwitch

log = logging.getLogger("batchkv.serve")
TRIM_STEPS = 4096  # the engine's own latency lists are cleared this often (they grow per step)
SWITCH_INTERVAL_S = 0.0005  # sys.setswitchinterval while the engine thread runs (CPython's default: 0.005)
HANDOFF_S = 0.002  # most an overlapping engine waits, per step, for the loop to write that step's tokens


class EngineWorker(Front):
    """Owns `engine` on a thread of its own. `max_waiting`: most requests queued for columns;
    `request_timeout`: seconds from arrival before a live request is ended (None: never)."""

    ENGINE = "the engine thread"

    def __init__(
        self, engine: Engine, metrics: ServerMetrics, *, max_waiting: int, request_timeout: float | None = None
    ) -> None:
        self.engine, self.metrics, self.max_waiting = engine, metrics, max_waiting
        self.request_timeout = request_timeout
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._expiry = Deadlines()  # engine request ids by the end of their time (request_timeout)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._run, name="batchkv-engine", daemon=True)
        self._steps = 0
        self._deadline: float | None = None  # draining: cancel what is live at this monotonic time
        self._handoff = bool(engine.overlap)  # wait for the loop's writes after each step (see above)
        self._switch = ShortSwitch(SWITCH_INTERVAL_S)  # held from start until the thread ends
        self._ended = False  # the thread is past its last command: `submit` answers for it
        self._front_init()

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

    def compile_constraint(self, constraint) -> None:
        """Compile a request's constraint for the engine (cached there; any thread, never the loop):
        APIError(400) naming its field when it cannot be (`structured.compile_constraint`)."""
        structured.compile_constraint(self.engine, constraint)

    def post(self, command: tuple) -> None:
        """Queue a command for the engine thread (any thread; signal-handler safe)."""
        self._commands.put(command)

    feeds_trackers = True  # `submit` takes a tracker to feed on this thread (the app asks)

    async def submit(self, requests: Sequence[Request], arrival: float, tracker: Tracker | None = None) -> Stream:
        """Queue engine requests as one stream. APIError 429 when the waiting queue is full, 400
        when the engine refuses one (then none of them is queued). With the job's `tracker`, this
        thread feeds it each step's events (`_feed`): the stream's items are then wakes (empty
        lists), and its reader takes the deltas from the tracker."""
        loop = asyncio.get_running_loop()
        stream, done = Stream(self), loop.create_future()
        stream.tracker = tracker
        self.post(("submit", stream, list(requests), arrival, done))
        return await self._answered(stream, done)

    # ---- engine thread -------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._serve()
        except Exception as exc:  # outside a step (`_step` survives a failed one): the thread ends
            log.exception("the engine thread failed; failing %d live requests", len(self._routes))
            self._fail_all(exc)
        finally:
            self._ended = True  # before the queue is emptied (see `submit`)
            while not self._commands.empty():  # this thread is its only reader
                self._refuse([self._commands.get_nowait()])
            self._switch.release()

    def _refuse(self, commands: list[tuple]) -> None:
        """Answer the submits among commands the thread will not apply: 503."""
        for command in commands:
            if command[0] == "submit":
                self._call(self._resolve, command[-1], self._ended_error())

    def _serve(self) -> None:
        engine = self.engine
        while True:
            if not engine.has_work and self._behind:  # no step to come: every waiting delta goes out now
                self._flush_behind()
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
            self._expire()
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

    def _expire(self) -> None:
        """Cancel the requests past their time; their "cancelled" events become "timeout" (`_deliver`)."""
        for rid in self._expiry.due(time.perf_counter(), self._routes.keys()):
            self._routes[rid].timed_out = True
            self.engine.cancel(rid)

    def _submit(self, stream: Stream, requests: list[Request], arrival: float, done: asyncio.Future) -> None:
        engine = self.engine
        error = refusal(self._deadline is not None, engine.num_waiting, len(requests), self.max_waiting)
        if error is not None:
            self._call(self._resolve, done, error)
            return
        try:
            try:
                for index, request in enumerate(requests):
                    rid = engine.submit(request)
                    stream.ids.append(rid)
                    self._routes[rid] = Route(stream, index, request.params.n, arrival)
                    if self.request_timeout is not None:
                        self._expiry.add(rid, arrival + self.request_timeout)
            except RequestError as exc:
                self._cancel(stream, None)
                self._call(self._resolve, done, APIError(400, str(exc)))
                return
            self.metrics.prompted.inc(sum(len(r.prompt_ids) for r in requests))
            self._observe()  # before the answer: a client that got its 200 sees itself counted
        except Exception:
            self._fail_submit(done)
            raise
        self._call(self._resolve, done, None)

    def _fail_submit(self, done: asyncio.Future) -> None:
        """The engine thread fails while a submit waits for its answer (it ends; `_run` fails the
        live streams and logs the error): the submitter gets a 500 that names no internals, not a wait
        that never ends."""
        error = APIError(500, "the engine thread failed; the server log has the detail", type="server_error")
        self._call(self._resolve, done, error)

    def _cancel(self, stream: Stream, prompt_index: int | None) -> None:
        for index, rid in enumerate(stream.ids):
            if prompt_index is None or index == prompt_index:
                self.engine.cancel(rid)
                self._routes.pop(rid, None)  # its "cancelled" events go nowhere

    def _cancel_all(self) -> None:
        for rid in list(self._routes):
            self.engine.cancel(rid)
        self._routes.clear()
        self._behind.clear()

    def _step(self) -> None:
        try:
            events = self.engine.step()
        except TensorParallelError:  # no later step can run: the thread ends (streams fail, submits 503)
            raise
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
        for event in events:  # a request's reused prompt tokens, known once it is admitted
            route = self._routes.get(event.request_id)
            if route is not None and route.prompt_index not in route.stream.cached:
                cached = self.engine.cached_tokens(event.request_id)
                if cached is not None:
                    route.stream.cached[route.prompt_index] = cached
                    self.metrics.cached.inc(cached)
        deliveries = self._feed(route_events(self._routes, events, self.metrics, time.perf_counter()))
        if deliveries and self._handoff:
            written = threading.Event()
            self._call(self._dispatch, deliveries, written)
            written.wait(HANDOFF_S)  # GIL released: the loop writes while the device runs the next step
        elif deliveries:
            self._call(self._dispatch, deliveries)

    def _observe(self) -> None:
        engine = self.engine
        cached = engine.cached_columns
        self.metrics.observe_engine(
            running=engine.num_running,
            waiting=engine.num_waiting,
            columns=len(engine.cache.sequences) - cached,
            cached=cached,
            captures=engine.runner.captures,
            positions=engine.kv_usage,
        )
