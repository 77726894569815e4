"""Where a streamed request's time goes inside `batchkv serve`: per-request hop times, for benchmarks.

`install()`, called before the server is built, wraps the engine worker and the SSE writer so that
each streamed request records these `time.perf_counter()` instants (CLOCK_MONOTONIC on Linux, so
comparable with a client's on the same machine):

    arrival     the handler started (before the body is read)
    posted      the submit command went on the engine thread's queue (body parsed, job made)
    picked      the engine thread applied it (it waits for the step in progress to end)
    produced    the engine step that sampled the request's first token returned
    dispatched  the loop ran the delivery of that step's events (`call_soon_threadsafe`)
    written     the first chunk with a token went to the transport

GET /debug/trace answers {response id: {hop: instant}}. A client adds `sent` (before its request
bytes) and `read` (its first token): `hops()` turns both into per-hop milliseconds. The wrapping
costs a few microseconds per step; it reaches into the worker's internals, so
tests/test_bench_serve.py runs it. A traced `batchkv serve`:

    python bench/serve_trace.py serve --model sensenova-u1-8b --port 8000 ...  # batchkv serve's options
"""

from __future__ import annotations

import itertools
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's batchkv

HOPS = ("sent", "arrival", "posted", "picked", "produced", "dispatched", "written", "read")


def install() -> None:
    """Wrap `EngineWorker` and the app's SSE writer (process-wide) and add GET /debug/trace."""
    from batchkv.serve import app as app_module
    from batchkv.serve.worker import EngineWorker

    trace: dict = {}  # Stream -> {hop: instant}; keeps the streams alive (a benchmark's worth)
    rids: dict = {}  # Stream -> response id

    def at(stream, hop: str, now: float) -> None:
        trace.setdefault(stream, {}).setdefault(hop, now)

    submit, apply, deliver, dispatch = (EngineWorker.submit, EngineWorker._submit, EngineWorker._deliver,
                                        EngineWorker._dispatch)  # fmt: skip

    async def traced_submit(self, requests, arrival):
        posted = time.perf_counter()  # `submit` posts before its first await
        stream = await submit(self, requests, arrival)
        at(stream, "arrival", arrival)
        at(stream, "posted", posted)
        return stream

    def traced_apply(self, stream, *args):
        at(stream, "picked", time.perf_counter())
        return apply(self, stream, *args)

    def traced_deliver(self, events):
        now = time.perf_counter()
        for event in events:
            route = self._routes.get(event.request_id)
            if route is not None and event.token is not None:
                at(route.stream, "produced", now)
        return deliver(self, events)

    def traced_dispatch(deliveries, *args):
        now = time.perf_counter()
        for stream in deliveries:
            at(stream, "dispatched", now)
        return dispatch(deliveries, *args)

    EngineWorker.submit, EngineWorker._submit, EngineWorker._deliver = traced_submit, traced_apply, traced_deliver
    EngineWorker._dispatch = staticmethod(traced_dispatch)

    chunks = app_module._chunks

    async def traced_chunks(tracker, stream, rid, *args, chat: bool):
        rids[stream] = rid
        skip = 1 if chat else 0  # chat's first chunk only names the role
        async for chunk in chunks(tracker, stream, rid, *args, chat=chat):
            if skip == 0:
                at(stream, "written", time.perf_counter())
            skip -= 1
            yield chunk

    app_module._chunks = traced_chunks
    build_app = app_module.build_app

    def traced_build_app(*args, **kwargs):
        app = build_app(*args, **kwargs)
        app.add_api_route("/debug/trace", lambda: {rids[s]: t for s, t in list(trace.items()) if s in rids})
        return app

    app_module.build_app = traced_build_app


def hops(client: list[dict], trace: dict[str, dict[str, float]]) -> dict:
    """Per-hop p50/p90 (ms) over the requests both sides saw, and `http_path`: per request, the time
    the server's HTTP layer adds around the engine, (posted - sent) + (read - produced).

    client: one dict per request with "id" (the response id), "sent" and "read" (perf_counter s).
    """
    rows = [{**trace[c["id"]], "sent": c["sent"], "read": c["read"]} for c in client if c.get("id") in trace]
    rows = [r for r in rows if all(h in r for h in HOPS)]
    out: dict = {"requests": len(rows)}
    if not rows:
        return out

    def stats(values: list[float]) -> dict[str, float]:
        return {"p50": float(np.percentile(values, 50)), "p90": float(np.percentile(values, 90))}

    for a, b in itertools.pairwise(HOPS):
        out[f"{a}->{b}"] = stats([1e3 * (r[b] - r[a]) for r in rows])
    out["http_path"] = stats([1e3 * ((r["posted"] - r["sent"]) + (r["read"] - r["produced"])) for r in rows])
    return out


if __name__ == "__main__":
    if sys.argv[1:2] != ["serve"]:
        sys.exit("usage: python bench/serve_trace.py serve --model ... (the options of `batchkv serve`)")
    install()
    from batchkv.cli import main

    sys.exit(main(sys.argv[1:]))
