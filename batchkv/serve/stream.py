"""One HTTP request as the engine thread sees it: its `Stream` of events, a `Route` per engine
request (`route_events` sorts a step's events onto them), and the `Deadlines` after which the
worker ends requests that ran too long.

A `Stream` may hold several engine requests (a batch of prompts), each with n samples; items on
its queue are lists of `(prompt_index, Event)`, or an exception.
"""

from __future__ import annotations

import asyncio
import heapq
from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from batchkv.executor import Event
from batchkv.serve.metrics import ServerMetrics, observe_many

PRUNE_AT = 1024  # deadline entries kept before finished requests' are dropped


class _Poster(Protocol):
    def post(self, command: tuple) -> None: ...


class Stream:
    """Events of one HTTP request's engine requests, delivered on the asyncio loop."""

    def __init__(self, worker: _Poster) -> None:
        self.worker = worker
        self.queue: asyncio.Queue[list[tuple[int, Event]] | BaseException] = asyncio.Queue()
        self.ids: list[int] = []  # engine request ids, by prompt index (engine thread only)
        self.cached: dict[int, int] = {}  # prompt index -> tokens it reused from the prefix cache
        self.tracker: Any = None  # an `outputs.Tracker` the engine thread feeds (then the items are wakes: [])
        self.key = 0  # its name in the engine process (`process.ProcessWorker`)

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
class Route:
    """Where one engine request's events go (engine thread only)."""

    stream: Stream
    prompt_index: int
    samples: int
    arrival: float  # perf_counter seconds
    last: dict[int, float] = field(default_factory=dict)  # sample -> time of its last token
    finished: int = 0
    timed_out: bool = False  # cancelled for running past the request time limit


def route_events(
    routes: dict[int, Route], events: list[Event], metrics: ServerMetrics, now: float
) -> dict[Stream, list[tuple[int, Event]]]:
    """One engine step's events by the stream they go to, counted and timed in `metrics` (time to
    first token per sample; the inter-token gaps observed once per distinct gap, as a step's
    tokens mostly share one); routes whose samples all finished are removed. Streams that got a
    sample's first token come first (the loop runs their readers first: those clients still wait
    out their time to first token). A timed-out route's "cancelled" events become "timeout"."""
    deliveries: dict[Stream, list] = {}
    firsts: dict[Stream, None] = {}  # streams with a sample's first token, in event order
    gaps: dict[float, int] = {}  # inter-token gap -> tokens that had it
    tokens = 0
    get = routes.get
    for event in events:
        route = get(event.request_id)
        if route is None:
            continue
        if event.token is not None:
            tokens += 1
            last = route.last.get(event.sample)
            if last is None:
                metrics.ttft.observe(now - route.arrival)
                firsts[route.stream] = None
            elif last != now:  # tokens accepted in one verify step arrive together: one gap, not zeros
                gap = now - last
                gaps[gap] = gaps.get(gap, 0) + 1
            route.last[event.sample] = now
        if event.finish_reason is not None:
            if route.timed_out and event.finish_reason == "cancelled":
                event = replace(event, finish_reason="timeout")
            route.finished += 1
            if route.finished == route.samples:
                del routes[event.request_id]
        items = deliveries.get(route.stream)
        if items is None:
            deliveries[route.stream] = [(route.prompt_index, event)]
        else:
            items.append((route.prompt_index, event))
    if tokens:
        metrics.generated.inc(tokens)
    for gap, count in gaps.items():
        observe_many(metrics.itl, gap, count)
    if not firsts:
        return deliveries
    return {stream: deliveries[stream] for stream in firsts} | deliveries


class Deadlines:
    """Engine request ids by the perf_counter second they must be done (a heap; ids that finished
    first stay until they come due or `due` prunes them, so the heap stays near the live count)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int]] = []

    def add(self, request_id: int, at: float) -> None:
        heapq.heappush(self._heap, (at, request_id))

    def due(self, now: float, live: Collection[int]) -> list[int]:
        """The `live` ids whose deadline is at or before `now`, removed (with any finished ones)."""
        heap, out = self._heap, []
        while heap and heap[0][0] <= now:
            rid = heapq.heappop(heap)[1]
            if rid in live:
                out.append(rid)
        if len(heap) > PRUNE_AT and len(heap) > 4 * len(live):
            self._heap = [entry for entry in heap if entry[1] in live]
            heapq.heapify(self._heap)
        return out
