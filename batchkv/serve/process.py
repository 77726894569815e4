"""`batchkv serve`'s engine in a process of its own: `ProcessWorker` is `EngineWorker`'s face (start,
stop, drain, alive, refuse_batch, submit, compile_constraint) over an engine process.

The engine process is started with multiprocessing's `spawn` (CUDA does not cross a fork) and builds
the model and the `Engine` itself, from `factory` (a picklable callable returning the engine and a
payload for the API process, such as the served model's `ModelInfo`). It runs `core.EngineCore`:
commands from this process between steps, one message per step back. Here, a sender thread
pickles the commands (so posting is safe from a signal handler, a bare `SimpleQueue.put`) and a
reader thread takes the step messages and runs the front half (`front.Front`: routing, metrics,
trackers, wakes) as the engine thread does in the in-thread mode. The engine's step, the
detokenising and the HTTP loop no longer share one GIL: the engine steps at its in-process rate
while this process detokenises and frames.

Failure: a startup error in the engine process (a bad model path, CUDA out of memory, a
CapacityError) is raised by `launch` here with its own type. An engine process that dies, or whose
core raises, ends every live stream with `EngineProcessError` (an error event, or a 500), answers
503 to submits, and `/health` answers 503. The engine process ignores SIGINT and SIGTERM (the API
process drains it) and ends when its pipe closes, so it never outlives the API process; `stop`
waits for it, then terminates and kills it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import pickle
import queue
import signal
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from batchkv.errors import EngineProcessError
from batchkv.executor import Request
from batchkv.serve.core import EngineCore, Sender, api_error, decode_events, observe
from batchkv.serve.front import Front
from batchkv.serve.outputs import Tracker
from batchkv.serve.stream import Route, Stream, route_events

log = logging.getLogger("batchkv.serve")
MERGE_STEPS = 8  # most step messages the reader feeds as one when it finds them waiting
STOP_WAIT_S = 10.0  # stop(): seconds the engine process gets to end before it is terminated


class ProcessWorker(Front):
    """The engine of `factory()` in a spawned process. `launch()` starts it and returns the payload;
    set `metrics` (a `ServerMetrics`) before `start`."""

    ENGINE = "the engine process"
    feeds_trackers = True  # the reader thread feeds the trackers (the app asks)

    def __init__(self, factory: Callable[[], tuple[Any, Any]], *, max_waiting: int,
                 request_timeout: float | None = None, log_level: str = "info") -> None:  # fmt: skip
        self.max_waiting, self.metrics = max_waiting, None
        self._front_init()
        self._loop: asyncio.AbstractEventLoop | None = None
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        settings = {"max_waiting": max_waiting, "request_timeout": request_timeout, "log_level": log_level.upper()}
        self.process = context.Process(target=_child, args=(factory, child, settings), name="batchkv-engine")
        self._child_conn = child
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_loop, name="batchkv-engine-sender", daemon=True)
        self._reader = threading.Thread(target=self._read_loop, name="batchkv-engine-reader", daemon=True)
        self._counter = itertools.count(1)
        self._lock = threading.Lock()  # _pending and _compiles: the loop and prepare threads add, the reader takes
        self._pending: dict[int, tuple[Stream, asyncio.Future, list[Request], float]] = {}
        self._compiles: dict[int, list] = {}  # token -> [threading.Event, error fields or None]
        self._ended = False
        self._stopping = False

    # ---- the API side ----------------------------------------------------------------------------
    def launch(self) -> Any:
        """Start the engine process and wait while it builds its engine (as long as it lives): its
        payload. Its startup error is raised here, with its type; the process is then gone."""
        self.process.start()
        self._child_conn.close()
        try:
            while not self._conn.poll(0.5) and self.process.is_alive():  # bounded by the child: it answers or exits
                pass
            try:
                kind, value = self._conn.recv()
            except (EOFError, OSError):  # it exited without a word
                self.process.join(5.0)
                kind, value = (
                    "exited",
                    EngineProcessError(
                        f"the engine process exited with status {self.process.exitcode} while it built the engine "
                        "(the log above has the detail)"
                    ),
                )
            except Exception as exc:  # an answer this process cannot unpickle (a class only the child imports)
                kind, value = (
                    "unreadable",
                    EngineProcessError(
                        f"the engine process's startup answer could not be read here: {type(exc).__name__}: {exc}"
                    ),
                )
        except BaseException:
            self._end_process()
            raise
        if kind != "ready":
            self._end_process()
            raise value
        return value

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Begin taking the engine's messages (after `launch`); events are delivered on `loop`."""
        if self._reader.ident is not None:
            raise RuntimeError("a ProcessWorker starts once; build another worker to serve again")
        self._loop = loop
        self._sender.start()
        self._reader.start()

    def stop(self, timeout: float = STOP_WAIT_S) -> None:
        """Cancel whatever is live and end the engine process (terminated, then killed, if it does
        not end within `timeout`)."""
        self._stopping = True
        self.post(("stop",))
        if not self._sender.is_alive() and self.process.is_alive():  # never started: send it here
            self._send(("stop",))
        self.process.join(timeout)
        self._end_process()
        if self._reader.ident is not None:
            self._reader.join(timeout)

    def _end_process(self) -> None:
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(2.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(2.0)
        self._conn.close()

    def drain(self, seconds: float) -> None:
        """Stop taking requests; cancel those still live after `seconds`. Signal-handler safe."""
        self.post(("drain", seconds))

    @property
    def alive(self) -> bool:
        return not self._ended and self.process.is_alive()

    def post(self, command: tuple) -> None:
        """Queue a command for the engine process (any thread; signal-handler safe). A stream's
        cancel names the stream's key there."""
        if command[0] == "cancel" and isinstance(command[1], Stream):
            command = ("cancel", command[1].key, command[2])
        self._commands.put(command)

    async def submit(self, requests: Sequence[Request], arrival: float, tracker: Tracker | None = None) -> Stream:
        """As `EngineWorker.submit`: 429 when the waiting queue is full, 400 when the engine refuses
        one (then none of them is queued), 503 once the engine process has stopped."""
        stream, done = Stream(self), asyncio.get_running_loop().create_future()
        stream.tracker, stream.key = tracker, next(self._counter)
        requests = list(requests)
        with self._lock:
            self._pending[stream.key] = (stream, done, requests, arrival)
        self.post(("submit", stream.key, requests, arrival))
        return await self._answered(stream, done)

    def compile_constraint(self, constraint: Any) -> None:
        """Compile a constraint where the engine runs (a thread of the engine process; its steps go
        on): APIError(400) naming the field when it cannot be, 503 once the process has stopped.
        Blocks: call it off the loop."""
        token, slot = next(self._counter), [threading.Event(), None]
        with self._lock:
            self._compiles[token] = slot
        self.post(("compile", token, constraint))
        while not slot[0].wait(0.5):  # bounded by the engine process: it answers or the reader ends
            if self._ended:
                raise self._ended_error()
        if slot[1] is not None:
            raise api_error(slot[1])

    def _cancel(self, stream: Stream, prompt_index: int | None) -> None:
        """(reader thread) Cancel a stream's requests: their events go nowhere from now on."""
        for index, rid in enumerate(stream.ids):
            if prompt_index is None or index == prompt_index:
                self._routes.pop(rid, None)
        self.post(("cancel", stream.key, prompt_index))

    # ---- the sender and the reader -------------------------------------------------------------
    def _send(self, command: tuple) -> bool:
        try:
            self._conn.send(command)
        except (OSError, ValueError):  # the engine process is gone: the reader ends the streams
            return False
        except Exception:  # a command that does not pickle (a bug): its submit or compile fails, not the pipe
            log.exception("a command for the engine process could not be sent")
            self._answer(command)
        return True

    def _answer(self, command: tuple) -> None:
        """A 500 for the submit or compile `command` that could not be sent."""
        fields = [500, "the request could not be handed to the engine process", "server_error", None, None]
        if command[0] == "submit":
            self._on_a(command[1], None, fields, None)
        elif command[0] == "compile":
            self._on_c(command[1], fields)

    def _send_loop(self) -> None:
        while True:
            command = self._commands.get()
            if not self._send(command) or command[0] == "stop":
                return

    def _read_loop(self) -> None:
        import msgspec

        decode, recv, poll = msgspec.msgpack.Decoder().decode, self._conn.recv_bytes, self._conn.poll
        failure: str | None = None
        ahead: list | None = None  # a message read while gathering steps
        try:
            while True:
                try:
                    message, ahead = ahead or decode(recv()), None
                    steps = [message] if message[0] == "s" else []
                    while steps and len(steps) < MERGE_STEPS and poll():  # steps waiting: fed as one
                        message = decode(recv())
                        if message[0] != "s":
                            ahead = message
                            break
                        steps.append(message)
                except (EOFError, OSError):
                    break
                if steps:
                    self._on_steps(steps)
                elif message[0] == "e":
                    failure = message[1]
                    break
                else:
                    getattr(self, "_on_" + message[0])(*message[1:])
        except Exception:
            log.exception("the engine process's messages failed; failing %d live requests", len(self._routes))
            failure = "its messages could not be read"
        finally:
            self._end(failure)

    def _end(self, failure: str | None) -> None:
        """The engine process is gone (or going): every live stream, waiting submit and compile fails."""
        self._ended = True
        if failure is not None or not self._stopping:
            self.process.join(1.0)
            how = failure or f"exited with status {self.process.exitcode}"
            log.error("the engine process %s; failing %d live requests", how, len(self._routes))
        self._fail_all(EngineProcessError("the engine process has stopped"))
        with self._lock:
            pending, self._pending = self._pending, {}
            compiles, self._compiles = self._compiles, {}
        for _, done, _, _ in pending.values():
            self._call(self._resolve, done, self._ended_error())
        for slot in compiles.values():
            slot[1] = [503, "the engine process has stopped", "server_error", None, None]
            slot[0].set()

    def _on_a(self, key: int, ids: list[int] | None, error: list | None, gauges: list | None) -> None:
        with self._lock:
            entry = self._pending.pop(key, None)
        if entry is None:
            return
        stream, done, requests, arrival = entry
        if error is not None:
            self._call(self._resolve, done, api_error(error))
            return
        stream.ids = ids or []
        for index, (rid, request) in enumerate(zip(stream.ids, requests, strict=True)):
            self._routes[rid] = Route(stream, index, request.params.n, arrival)
        self.metrics.prompted.inc(sum(len(r.prompt_ids) for r in requests))
        observe(self.metrics, gauges or [])  # before the answer: a client that got its 200 sees itself counted
        self._call(self._resolve, done, None)

    def _on_steps(self, steps: list[list]) -> None:
        """Steps' messages (`["s", gauges, cached, events, t]`, in order) fed as one step: each step's
        events routed at its own time (now, less how much earlier the engine ended it than the last),
        so that a request's tokens of merged steps each count their inter-token gap."""
        metrics = self.metrics
        observe(metrics, steps[-1][1])  # before the tokens go out: a client that saw them sees this state
        now, last = time.perf_counter(), steps[-1][4]
        deliveries: dict[Stream, list] = {}
        for step in steps:
            for rid, tokens in step[2]:
                route = self._routes.get(rid)
                if route is not None:
                    route.stream.cached[route.prompt_index] = tokens
                    metrics.cached.inc(tokens)
            for stream, items in route_events(
                self._routes, decode_events(step[3]), metrics, now - (last - step[4])
            ).items():
                deliveries.setdefault(stream, []).extend(items)
        fed = self._feed(deliveries)
        if fed:
            self._call(self._dispatch, fed)

    def _on_d(self, ids: list[int]) -> None:
        for rid in ids:
            self._routes.pop(rid, None)

    def _on_x(self, ids: list[int]) -> None:
        for rid in ids:
            route = self._routes.get(rid)
            if route is not None:
                route.timed_out = True

    def _on_f(self) -> None:
        self._fail_all(EngineProcessError("the engine step failed (the server log has the detail)"))

    def _on_i(self, gauges: list) -> None:
        observe(self.metrics, gauges)
        self._flush_behind()

    def _on_c(self, token: int, error: list | None) -> None:
        with self._lock:
            slot = self._compiles.pop(token, None)
        if slot is not None:
            slot[1] = error
            slot[0].set()


def _child(factory: Callable[[], tuple[Any, Any]], conn: Any, settings: dict) -> None:
    """The engine process: build the engine, say so (or why not), then serve commands until a stop
    or until the API process's end of the pipe closes."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)  # the API process drains this one and stops it
    logging.basicConfig(level=settings["log_level"], format="%(levelname)s:     %(name)s: %(message)s")
    try:
        engine, payload = factory()
    except BaseException as exc:
        conn.send(("error", _portable(exc)))
        raise SystemExit(1) from None
    try:
        conn.send(("ready", payload))  # pickled whole before a byte is written
    except Exception as exc:  # a payload that does not pickle: a startup error like any other
        conn.send(("error", EngineProcessError(f"the engine's startup answer does not pickle: {type(exc).__name__}: "
                                               f"{exc}")))  # fmt: skip
        engine.close()
        raise SystemExit(1) from None
    try:
        core = EngineCore(engine, Sender(conn), max_waiting=settings["max_waiting"],
                          request_timeout=settings["request_timeout"])  # fmt: skip

        def receive(timeout: float | None) -> tuple | None:
            if timeout is not None and not conn.poll(timeout):
                return None
            return conn.recv()

        core.serve(receive, conn.poll)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the API process is gone: so is this one
    except BaseException as exc:
        log.exception("the engine process failed")
        with contextlib.suppress(OSError):
            Sender(conn)(["e", f"failed: {type(exc).__name__}"])
    finally:
        engine.close()


def _portable(exc: BaseException) -> BaseException:
    """`exc` if it survives pickling, else an EngineProcessError carrying its type and message."""
    try:
        return pickle.loads(pickle.dumps(exc))
    except Exception:
        return EngineProcessError(f"{type(exc).__name__}: {exc}")
