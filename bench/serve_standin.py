"""An engine stand-in for serving measurements on the CPU: the H200's step rhythm without the model.

`StandinEngine` has the surface `EngineWorker` and `bench.online.run_online` use (submit, cancel,
step, has_work, overlap, num_waiting, num_running, cache.sequences, runner.captures, metrics) and
the overlapped engine's timing: `step()` plans and launches step N+1 holding the GIL for `host_ms`
(a pure-Python spin, as host planning is), then waits for step N on the "device" with the GIL
released (`time.sleep` until step N's end; the device runs one step of `device_ms` at a time, each
starting when it is launched or when the previous one ends), then returns step N's events. A
request prefills in ceil(len(prompt) / chunk) steps; the last prefill step samples its first token,
every later step one more; tokens are `request_id % vocab`. No tokenizer: token-id prompts only.
The step budget is not modelled: every running request advances each step.

Run as a script, it is `batchkv serve` over the stand-in (the same worker, app and uvicorn), with
the hop trace of `bench/serve_trace.py` at GET /debug/trace:
    python bench/serve_standin.py --port 8000 --host-ms 3 --device-ms 9
"""

from __future__ import annotations

import argparse
import math
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's batchkv

from batchkv.errors import RequestError
from batchkv.executor import Event, Request


@dataclass
class _Live:
    rid: int
    prefill_steps: int  # steps left before the first token
    left: int  # tokens left to emit


@dataclass
class _Launched:
    done_at: float  # perf_counter seconds when the device finishes it
    events: list[Event] = field(default_factory=list)


def spin(seconds: float) -> None:
    """Hold the GIL for `seconds` of Python bytecode (the interpreter may still switch threads)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class StandinEngine:
    """An overlapped engine whose steps cost `host_ms` with the GIL and `device_ms` without it."""

    overlap = True

    def __init__(self, *, host_ms: float, device_ms: float, max_seqs: int = 64, chunk: int = 512, vocab: int = 512):
        self.host_s, self.device_s = host_ms / 1e3, device_ms / 1e3
        self.max_seqs, self.chunk, self.vocab_size = max_seqs, chunk, vocab
        self.waiting: list[_Live] = []
        self.running: dict[int, _Live] = {}  # admitted, with tokens left to launch (a column each)
        self.cancelled: list[Event] = []  # "cancelled" events for the next step() to return
        self.dropped: set[int] = set()  # cancelled: tokens already launched for them are discarded
        self.in_flight: _Launched | None = None
        self.device_free = 0.0  # when the device finishes what it was given
        self.next_id = 0
        self.cache = SimpleNamespace(sequences=[])
        self.runner = SimpleNamespace(captures=0)
        self.metrics = SimpleNamespace(step_times=[], inter_token=[], first_token=[])

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.in_flight or self.cancelled)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    cached_columns = 0  # the stand-in reuses no prefix
    kv_usage = (0, 1)  # (positions held, the store's): the stand-in holds none

    def cached_tokens(self, rid: int) -> int | None:
        return 0 if rid in self.running else None

    def submit(self, request: Request) -> int:
        if not request.prompt_ids or max(request.prompt_ids) >= self.vocab_size or min(request.prompt_ids) < 0:
            raise RequestError(f"request refused: prompt token ids must lie in [0, {self.vocab_size})")
        rid, self.next_id = self.next_id, self.next_id + 1
        steps = math.ceil(len(request.prompt_ids) / self.chunk)
        self.waiting.append(_Live(rid, steps, request.params.max_new_tokens))
        return rid

    def cancel(self, rid: int) -> bool:
        waiting = [w for w in self.waiting if w.rid != rid]
        if rid not in self.running and len(waiting) == len(self.waiting):
            return False
        self.running.pop(rid, None)
        self.waiting = waiting
        self.dropped.add(rid)
        self.cancelled.append(Event(rid, None, "cancelled"))
        self.cache.sequences = list(self.running)
        return True

    def step(self) -> list[Event]:
        """Launch the next step (host_ms with the GIL), then finish the previous one (GIL free)."""
        launched = self._launch()
        done, self.in_flight = self.in_flight, launched
        events, self.cancelled = self.cancelled, []
        if done is not None:
            time.sleep(max(0.0, done.done_at - time.perf_counter()))
            events += [e for e in done.events if e.request_id not in self.dropped]
        return events

    def _launch(self) -> _Launched | None:
        while self.waiting and len(self.running) < self.max_seqs:
            live = self.waiting.pop(0)
            self.running[live.rid] = live
        if not self.running:
            return None
        spin(self.host_s)
        self.device_free = max(time.perf_counter(), self.device_free) + self.device_s
        step = _Launched(self.device_free)
        for live in list(self.running.values()):
            live.prefill_steps = max(live.prefill_steps - 1, 0)
            if live.prefill_steps == 0:
                live.left -= 1
                step.events.append(Event(live.rid, live.rid % self.vocab_size, "length" if live.left == 0 else None))
                if live.left == 0:  # its column frees when its last token is launched, as the engine's does
                    del self.running[live.rid]
        self.cache.sequences = list(self.running)
        return step


def main(argv: list[str] | None = None) -> None:
    """Serve the stand-in over HTTP until SIGINT/SIGTERM, with the hop trace installed."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host-ms", type=float, default=3.0, help="GIL-holding planning per step (3)")
    ap.add_argument("--device-ms", type=float, default=9.0, help="GIL-free device time per step (9)")
    ap.add_argument("--max-seqs", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=512, help="prompt tokens per prefill step (512)")
    args = ap.parse_args(argv)
    import uvicorn

    from bench import serve_trace

    serve_trace.install()
    from batchkv.serve.app import build_app
    from batchkv.serve.jobs import ModelInfo
    from batchkv.serve.metrics import ServerMetrics
    from batchkv.serve.worker import EngineWorker

    engine = StandinEngine(host_ms=args.host_ms, device_ms=args.device_ms, max_seqs=args.max_seqs, chunk=args.chunk)
    metrics = ServerMetrics(engine.max_seqs)
    worker = EngineWorker(engine, metrics, max_waiting=1 << 20)  # type: ignore[arg-type]
    app = build_app(worker, ModelInfo("standin", None, 1 << 20), metrics)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", args.port))
    try:
        uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on")).run(sockets=[sock])
    finally:
        sock.close()


if __name__ == "__main__":
    main()
