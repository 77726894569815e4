"""Timing shared by the benchmarks: CUDA-graph replay between CUDA events, or wall clock on CPU.

On CUDA a list of calls is captured once into one graph (after two warm-up runs on a side stream)
and the graph is replayed between events; a time is the median over replays divided by the calls
per graph. Calls that cannot be captured are timed eagerly between events, and the result says so.
On CPU (smoke runs) the calls run back to back under `time.perf_counter`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch


def capture(fn: Callable[[], object], error_mode: str = "global") -> torch.cuda.CUDAGraph:
    """A CUDA graph of `fn`, warmed up twice on a side stream first (cuBLAS handles, allocations);
    `error_mode` "thread_local" for NCCL collectives."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode=error_mode):
        fn()
    return graph


def median_us(run: Callable[[], object], replays: int) -> float:
    """Median µs of `run` over `replays` runs, each between two CUDA events (one warm run first)."""
    run()
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
    for start, end in pairs:
        start.record()
        run()
        end.record()
    torch.cuda.synchronize()
    return 1000 * statistics.median(s.elapsed_time(e) for s, e in pairs)


def _replays(run: Callable[[], object], budget_s: float, most: int) -> int:
    """Replays that fit `budget_s`, from one timed run: at least 10 (3 on CPU), at most `most`."""
    start = time.perf_counter()
    run()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    once = max(time.perf_counter() - start, 1e-6)
    return int(max(10 if torch.cuda.is_available() else 3, min(most, budget_s / once)))


def time_calls(calls: Sequence[Callable[[], object]], replays: int = 100, budget_s: float = 0.5) -> tuple[float, str]:
    """Median µs per call of `calls` run back to back, and how it was timed ("graph", "events (...)", "wall").

    Replays: `replays`, fewer when they would take longer than `budget_s` (never below 10).
    """

    def run_all() -> None:
        for call in calls:
            call()

    if not torch.cuda.is_available():
        run_all()
        times = []
        for _ in range(_replays(run_all, budget_s, replays)):
            start = time.perf_counter()
            run_all()
            times.append(time.perf_counter() - start)
        return 1e6 * statistics.median(times) / len(calls), "wall"
    try:
        graph = capture(run_all)
        return median_us(graph.replay, _replays(graph.replay, budget_s, replays)) / len(calls), "graph"
    except Exception as exc:  # a peer that cannot be captured is timed eagerly, and says so
        torch.cuda.synchronize()
        return median_us(run_all, _replays(run_all, budget_s, replays)) / len(calls), f"events ({type(exc).__name__})"


class Deadline:
    """Seconds left of a budget that started at construction."""

    def __init__(self, budget_s: float) -> None:
        self.end = time.perf_counter() + budget_s

    def left(self) -> float:
        return max(0.0, self.end - time.perf_counter())
