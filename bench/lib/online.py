"""Online serving: requests arrive as a Poisson process and the engine is stepped by the wall clock.

`run_online` submits each request when its arrival time comes and steps the engine in between;
time to first token counts from the request's arrival (not from the run's start, and not from the
moment a busy step let it be submitted), inter-token latency is the gap between consecutive tokens
of one request. Greedy decoding, exactly `outputs[i]` tokens per request, no stop tokens.

    arrivals = poisson_arrivals(len(prompts), rate=2.0)
    result = run_online(engine, prompts, outputs, arrivals)  # {"rate", "tokens_per_s", "ttft_p50_ms", ...}
"""

from __future__ import annotations

import time

import numpy as np

from batchkv.executor import Request, SamplingParams


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    """Arrival times (seconds from the start) of `n` requests of a Poisson process of `rate` per second."""
    if n < 1 or not rate > 0:
        raise ValueError(f"poisson_arrivals needs n >= 1 and rate > 0 (got n={n}, rate={rate})")
    return np.cumsum(np.random.default_rng(seed).exponential(1.0 / rate, n)).tolist()


def run_online(engine, prompts: list[list[int]], outputs: list[int], arrivals: list[float]) -> dict:
    """Serve `prompts` (outputs[i] greedy tokens each) arriving at `arrivals` (s, ascending) on `engine`.

    Returns {"rate", "requests", "tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms",
    "itl_p99_ms", "wall_s", "tokens"}: rate is the arrivals' own (requests / last arrival), wall_s
    runs from the start to the last token, tokens/s is generated tokens over wall_s. The engine
    should be idle and warm (graphs captured) so that captures are not timed as latency.
    """
    if not (len(prompts) == len(outputs) == len(arrivals)) or not prompts:
        raise ValueError("run_online needs one output length and one arrival time per prompt")
    if list(arrivals) != sorted(arrivals):
        raise ValueError("arrival times must be in ascending order")
    start = time.perf_counter()
    arrived: dict[int, float] = {}  # request id -> absolute arrival time
    last: dict[int, float] = {}  # request id -> time of its latest token
    first, gaps = [], []
    tokens, nxt = 0, 0
    while nxt < len(prompts) or engine.has_work:
        now = time.perf_counter()
        while nxt < len(prompts) and start + arrivals[nxt] <= now:
            request = Request(prompts[nxt], SamplingParams(max_new_tokens=outputs[nxt]))
            rid = engine.submit(request)
            arrived[rid] = start + arrivals[nxt]
            nxt += 1
        if not engine.has_work:
            time.sleep(max(0.0, start + arrivals[nxt] - time.perf_counter()))
            continue
        events = engine.step()
        now = time.perf_counter()
        for event in events:
            if event.token is None:
                continue
            tokens += 1
            rid = event.request_id
            if rid in last:
                gaps.append(now - last[rid])
            else:
                first.append(now - arrived[rid])
            last[rid] = now
    wall = max(last.values()) - start if last else 0.0
    return {
        "rate": len(arrivals) / arrivals[-1] if arrivals[-1] > 0 else float("inf"),
        "requests": len(prompts),
        "tokens_per_s": tokens / wall if wall else 0.0,
        **{
            f"{name}_p{q}_ms": float(np.percentile(np.asarray(values) * 1e3, q)) if len(values) else None
            for name, values in (("ttft", first), ("itl", gaps))
            for q in (50, 99)
        },
        "wall_s": wall,
        "tokens": tokens,
    }
