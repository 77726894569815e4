"""Stand-in for bench/online.py's `poisson_arrivals` and `run_online` (same signatures and keys),
used by bench/serve_http.py only while bench/online.py is absent. Delete once it lands."""

from __future__ import annotations

import time

import numpy as np

from batchkv.executor import Engine, Request, SamplingParams


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """Arrival times in seconds from the start: exponential gaps of mean 1/rate, the first at 0."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, n)
    return np.concatenate([[0.0], np.cumsum(gaps[1:])]).tolist()


def run_online(engine: Engine, prompts: list[list[int]], outputs: list[int], arrivals: list[float]) -> dict:
    """Submit each greedy request at its arrival time, step until all finish; client-side metrics."""
    start = time.perf_counter()
    order = sorted(range(len(prompts)), key=lambda i: arrivals[i])
    sent: dict[int, float] = {}
    last: dict[int, float] = {}
    ttft, itl, tokens, cursor = [], [], 0, 0
    while cursor < len(order) or engine.has_work:
        now = time.perf_counter() - start
        while cursor < len(order) and arrivals[order[cursor]] <= now:
            i = order[cursor]
            rid = engine.submit(Request(prompts[i], SamplingParams(max_new_tokens=outputs[i])))
            sent[rid] = start + arrivals[i]
            cursor += 1
        if not engine.has_work:
            time.sleep(max(0.0, arrivals[order[cursor]] - (time.perf_counter() - start)))
            continue
        events = engine.step()
        t = time.perf_counter()
        for ev in events:
            if ev.token is None:
                continue
            tokens += 1
            if ev.request_id in last:
                itl.append(t - last[ev.request_id])
            else:
                ttft.append(t - sent[ev.request_id])
            last[ev.request_id] = t
    wall = time.perf_counter() - start
    p = lambda v, q: 1e3 * float(np.percentile(v, q)) if v else 0.0  # noqa: E731
    rate = len(prompts) / max(arrivals[-1], 1e-9) if len(prompts) > 1 else 0.0
    return {"rate": rate, "requests": len(prompts), "tokens_per_s": tokens / wall, "ttft_p50_ms": p(ttft, 50),
            "ttft_p99_ms": p(ttft, 99), "itl_p50_ms": p(itl, 50), "itl_p99_ms": p(itl, 99), "wall_s": wall}  # fmt: skip
