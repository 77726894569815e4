"""The server's front half: what happens to a step's events once the engine made them, wherever the
engine runs (on a thread of this process, `worker.EngineWorker`, or in a process of its own,
`process.ProcessWorker`).

The events are routed to their streams (`stream.route_events`: counted and timed in the metrics),
fed to the streams' `Tracker`s (detokenising, stop strings, logprobs, finishes) and the loop gets
only wakes, at most `WAKES_PER_STEP` a step for deltas that are neither a stream's first token nor
a finish (docs/design.md, "HTTP server"). Everything here runs on one thread beside the loop (the
engine thread, or the process worker's reader); the loop gets each step's wakes in one
`call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading

from batchkv.serve.outputs import PENDING, URGENT
from batchkv.serve.protocol import APIError
from batchkv.serve.stream import Route, Stream

log = logging.getLogger("batchkv.serve")
WAKES_PER_STEP = 32  # streams woken per step for deltas that are neither a first token nor a finish


class Front:
    """The front half's state and steps (a base: the worker says how a stream's requests are cancelled,
    `_cancel`)."""

    max_waiting: int
    _loop: asyncio.AbstractEventLoop | None
    _ended: bool  # the engine half is past its last command: submits get `_ended_error`
    ENGINE = "the engine"  # what `_ended_error` says has stopped: the engine thread, or its process

    def _front_init(self) -> None:
        self._routes: dict[int, Route] = {}  # engine request id -> where its events go
        self._behind: dict[Stream, None] = {}  # streams whose deltas wait for a wake, longest first

    def _cancel(self, stream: Stream, prompt_index: int | None) -> None:
        raise NotImplementedError

    def refuse_batch(self, prompts: int) -> None:
        """APIError(400) for a batch of more prompts than the queue could ever hold (any thread: the
        HTTP layer asks before it tokenises them; the engine half asks again)."""
        if prompts > self.max_waiting:
            raise batch_error(prompts, self.max_waiting)

    def _ended_error(self) -> APIError:
        return APIError(503, f"{self.ENGINE} has stopped", type="server_error")

    async def _answered(self, stream: Stream, done: asyncio.Future) -> Stream:
        """`stream` once its posted submit is answered (`done`; 503 now if the engine half ended
        before it could take it); a wait cancelled meanwhile cancels the stream, after the submit
        (commands are FIFO)."""
        if self._ended:  # set before the engine half answered what was waiting: this one may be missed
            self._resolve(done, self._ended_error())
        try:
            await done
        except asyncio.CancelledError:
            stream.cancel()
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
    def _dispatch(deliveries: dict[Stream, list | BaseException], written: threading.Event | None = None) -> None:
        for stream, items in deliveries.items():
            stream.queue.put_nowait(items)
        if written is not None:  # callbacks run in order: the readers woken above write their chunks first
            asyncio.get_running_loop().call_soon(written.set)

    def _fail_all(self, exc: BaseException) -> None:
        """Every routed stream gets `exc` (their requests are gone); the routes are dropped."""
        streams = {route.stream for route in self._routes.values()}
        self._routes.clear()
        self._behind.clear()
        if streams:
            self._call(self._dispatch, dict.fromkeys(streams, exc))

    def _feed(self, deliveries: dict[Stream, list]) -> dict[Stream, list | BaseException]:
        """Feed the step's events to the streams' trackers; what goes to the loop: raw events for
        a stream without a tracker, a wake (an empty list) for the readers woken this step, or the
        error a feed raised (that stream fails and its requests are cancelled; the others go on).

        Woken this step: every tracker with a first delta or a finish, and of those with streamed
        deltas waiting, the `WAKES_PER_STEP` that have waited longest (`_behind`, oldest first).
        The rest keep merging their deltas until their turn: with many streams each chunk carries
        several tokens, so the loop's work per step stays bounded (a chunk costs the loop about as
        much whatever its length); with few, every stream gets a chunk every step."""
        fed: dict[Stream, list | BaseException] = {}
        behind = self._behind
        for stream, items in deliveries.items():
            tracker = stream.tracker
            if tracker is None:
                fed[stream] = items
                continue
            try:
                need = tracker.feed(items, lambda prompt, stream=stream: self._cancel(stream, prompt))
            except Exception as exc:
                log.exception("a stream's output failed; cancelling its requests")
                self._cancel(stream, None)
                behind.pop(stream, None)
                fed[stream] = exc
                continue
            if need == URGENT:
                behind.pop(stream, None)
                if tracker.wake():
                    fed[stream] = []
            elif need == PENDING and stream not in behind:
                behind[stream] = None
        self._wake_behind(fed, WAKES_PER_STEP)
        return fed

    def _wake_behind(self, fed: dict[Stream, list | BaseException], most: int) -> None:
        """Wake up to `most` of the longest-waiting trackers (into `fed`)."""
        behind = self._behind
        while behind and most > 0:
            stream = next(iter(behind))
            del behind[stream]
            if stream.tracker is not None and stream.tracker.wake():
                fed[stream] = []
                most -= 1

    def _flush_behind(self) -> None:
        """No step to come: every waiting delta goes out now."""
        fed: dict[Stream, list | BaseException] = {}
        self._wake_behind(fed, len(self._behind))
        if fed:
            self._call(self._dispatch, fed)


def batch_error(prompts: int, most: int) -> APIError:
    """The 400 for a batch of more prompts than `most` (--max-waiting) could ever queue."""
    message = (f"the request holds {prompts} prompts; this server queues at most {most} (the server's "
               "--max-waiting), so it could never be admitted: send fewer prompts per request")  # fmt: skip
    return APIError(400, message, param="prompt", code="batch_too_large")


def refusal(draining: bool, waiting: int, prompts: int, most: int) -> APIError | None:
    """Why a submit of `prompts` engine requests is refused now (`waiting` wait for columns, the queue
    holds `most`), or None."""
    if draining:
        return APIError(503, "the server is shutting down; retry on another replica", type="server_error")
    if prompts > most:
        return batch_error(prompts, most)
    if waiting + prompts > most:
        message = (f"the server is busy: {waiting} requests are waiting for columns and the queue holds {most} "
                   "(retry later; the server's --max-waiting sets the queue)")  # fmt: skip
        return APIError(429, message, type="rate_limit_error", code="queue_full")
    return None
