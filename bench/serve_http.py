"""HTTP serving against the in-process engine: what `batchkv serve` costs at the same load.

The SenseNova-U1-8B preset (random weights, token-id prompts), prompts U[64, 2048] and outputs
U[64, 1024] tokens (greedy, no stop: every request runs to its length), Poisson arrivals at three
rates. For each rate the same requests, at the same arrival times, go (1) straight into an
`Engine` through `bench.online.run_online`, then (2) over HTTP to a `batchkv serve` subprocess with
the same engine settings, streamed (`stream: true`) and timed by `bench/serve_client.py`: TTFT
from sending the request to reading its first token, inter-token latency between token reads,
throughput = output tokens / wall. Both sides warm up first on the same burst (graph captures,
storage growth to capacity). The server runs under `bench/serve_trace.py`, which times each
request's hops inside it (`hops_ms`: per hop p50/p90, and `http_path`, the HTTP layer's own time
per request: send to posted command, plus token's step to client read).

Target: HTTP costs <= 5% throughput and <= 2 ms p50 TTFT. The TTFT target is judged on
`http_path_ms.p50` (the `judged_ttft_ms` of each rate), unless the paired mean's 90% interval
lies wholly above it; then on the paired mean. `http_path_ms`: per request, the time the HTTP
layer adds around the engine, from the client's send to the submit command on the engine thread's
queue plus from the engine step that sampled the first token to the client's read of it, taken
on one clock by the client and, through `bench/serve_trace.py`, the server; no step phase is in
it. The end-to-end comparisons stand beside it: `ttft_cost_ms`, the per-request differences (TTFT
over HTTP - TTFT in process, same prompt, output and arrival time; p50, p90, mean, bootstrap 90%
intervals of p50 and mean), and `ttft_p50_cost_ms`, the difference of the two runs' p50s (kept
for older files). Neither resolves 2 ms at 15-100 requests a rate: a request waits for the next
step boundary (up to a step, 7-16 ms), and the two runs' step rhythms sit at different phases.
Pairing cancels prompt length and load, which the difference of p50s does not, but a steady
rhythm shifts every pair alike, which moves the paired median as a whole (on the CPU stand-in one
build gave -2.7 and +2.4 ms at the same rate in two runs). The paired mean is not biased by the
phase, and it also carries what `http_path_ms` cannot see: HTTP slowing the engine's own steps
(the loop and the engine share the GIL). With overlap on the stand-in it came out near 0 beside
an `http_path_ms` of 1.5 ms, since part of the HTTP hops runs while a request would wait anyway
(for the next step boundary, or for the step in flight while the loop writes). On the tiny
preset (`--small`: host-bound, no overlap, 6-24 requests a rate) it swings by +-10 ms between
runs: a smoke test, not a measurement.

On the H200 (needs the serve wheels in .whl/, see bench/results/README.md; about 3.5 minutes):
    OUT=/tmp/out bash bench/gpu_session.sh serve
On the CPU, over `bench/serve_standin.py` (an engine with the H200's step rhythm: a GIL-holding
plan, then a GIL-free device wait; about a minute):
    python bench/serve_http.py --standin --out /tmp/serve-http-standin.json
CPU smoke test of the real path (tiny preset, seconds):
    python bench/serve_http.py --small --out /tmp/serve-http-smoke.json
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's batchkv

from batchkv.executor import Engine, Request, SamplingParams
from batchkv.models import build_model
from bench import serve_client, serve_trace
from bench.online import poisson_arrivals, run_online
from bench.serve_standin import StandinEngine

FULL = {"preset": "sensenova-u1-8b", "prompt": (64, 2048), "output": (64, 1024), "rates": (1.0, 2.0, 4.0),
        "window_s": 20.0, "rate_timeout_s": 40.0, "max_seqs": 64, "budget": 1024, "chunk": 512}  # fmt: skip
SMALL = {"preset": "sensenova-u1-tiny", "prompt": (8, 48), "output": (8, 32), "rates": (4.0, 8.0, 16.0),
         "window_s": 1.5, "rate_timeout_s": 30.0, "max_seqs": 8, "budget": 64, "chunk": 32}  # fmt: skip
STANDIN = {"preset": "standin", "prompt": (64, 2048), "output": (16, 128), "rates": (10.0, 20.0, 40.0),
           "window_s": 8.0, "rate_timeout_s": 30.0, "max_seqs": 64, "budget": 1024, "chunk": 512,
           "vocab": 512, "host_ms": 3.0, "device_ms": 9.0}  # fmt: skip
ROOT = Path(__file__).resolve().parents[1]
CLIENT = "bench/serve_client.py: HTTP/1.1 over asyncio streams, keep-alive, uvloop when installed"


def workload(cfg: dict, rate: float, vocab: int, seed: int) -> tuple[list[list[int]], list[int], list[float]]:
    n = max(4, round(rate * cfg["window_s"]))
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, vocab, int(rng.integers(cfg["prompt"][0], cfg["prompt"][1] + 1))).tolist()
               for _ in range(n)]  # fmt: skip
    outputs = [int(rng.integers(cfg["output"][0], cfg["output"][1] + 1)) for _ in range(n)]
    return prompts, outputs, poisson_arrivals(n, rate, seed=seed)


def warmup_burst(cfg: dict, vocab: int) -> tuple[list[list[int]], list[int]]:
    """The longest prompt and output (storage grows to capacity), then a burst of mixed prompts."""
    rng = np.random.default_rng(99)
    lo, hi = cfg["prompt"]
    prompts = [rng.integers(0, vocab, hi).tolist()] + [rng.integers(0, vocab, int(rng.integers(lo, hi + 1))).tolist()
                                                       for _ in range(15)]  # fmt: skip
    return prompts, [cfg["output"][1]] + [8] * 15


def _percentiles(values: list[float]) -> tuple[float, float]:
    return (float(np.percentile(values, 50)), float(np.percentile(values, 99))) if values else (0.0, 0.0)


# ---- in process --------------------------------------------------------------------------------
def engine_side(cfg: dict, device: str, runs: list[tuple]) -> list[dict]:
    if cfg["preset"] == "standin":
        engine = StandinEngine(host_ms=cfg["host_ms"], device_ms=cfg["device_ms"], max_seqs=cfg["max_seqs"],
                               chunk=cfg["chunk"], vocab=cfg["vocab"])  # fmt: skip
    else:
        engine = Engine(build_model(cfg["preset"], device, seed=0), max_seqs=cfg["max_seqs"],
                        capacity=cfg["capacity"], max_step_tokens=cfg["budget"], prefill_chunk=cfg["chunk"],
                        device=device)  # fmt: skip
        for prompt, output in zip(*warmup_burst(cfg, engine.vocab_size), strict=True):
            engine.submit(Request(prompt, SamplingParams(max_new_tokens=output)))
        engine.run_until_done()
    results = []
    for prompts, outputs, arrivals in runs:
        results.append(run_online(engine, prompts, outputs, arrivals, per_request=True))
        print(f"engine  rate {results[-1]['rate']:.1f}: {results[-1]['tokens_per_s']:.0f} tok/s, "
              f"TTFT p50 {results[-1]['ttft_p50_ms']:.1f} ms", flush=True)  # fmt: skip
    del engine  # the model with it: the server needs the device memory
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return results


# ---- over HTTP ---------------------------------------------------------------------------------
def _http_run(port: int, prompts, outputs, arrivals, timeout: float) -> dict:
    bodies = [json.dumps({"prompt": p, "max_tokens": o, "temperature": 0, "stream": True, "ignore_eos": True}).encode()
              for p, o in zip(prompts, outputs, strict=True)]  # fmt: skip
    records = serve_client.run(port, "/v1/completions", bodies, arrivals, timeout)
    t0 = records[0]["due"] - arrivals[0]  # the client's start: arrivals count from it
    ends = [r["times"][-1] for r in records if r["times"]]
    wall = max(max(ends, default=t0) - t0, 1e-9)
    ttft = [1e3 * (r["times"][0] - r["sent"]) if r["times"] else None for r in records]
    itl = [1e3 * (b - a) for r in records for a, b in itertools.pairwise(r["times"]) if b > a]
    tokens = sum(len(r["times"]) for r in records)
    (t50, t99), (i50, i99) = _percentiles([t for t in ttft if t is not None]), _percentiles(itl)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/debug/trace", timeout=30) as answer:
        trace = json.loads(answer.read())
    firsts = [{"id": r["id"], "sent": r["sent"], "read": r["times"][0]} for r in records if r["times"] and "id" in r]
    return {"requests": len(prompts), "incomplete": sum(r["incomplete"] for r in records), "tokens": tokens,
            "tokens_per_s": tokens / wall, "ttft_p50_ms": t50, "ttft_p99_ms": t99, "itl_p50_ms": i50,
            "itl_p99_ms": i99, "wall_s": wall, "hops_ms": serve_trace.hops(firsts, trace),
            "ttft_ms_by_request": ttft}  # fmt: skip


def _server_command(cfg: dict, device: str, port: int) -> list[str]:
    if cfg["preset"] == "standin":
        return [sys.executable, str(ROOT / "bench/serve_standin.py"), "--port", str(port), "--host-ms",
                str(cfg["host_ms"]), "--device-ms", str(cfg["device_ms"]), "--max-seqs", str(cfg["max_seqs"]),
                "--chunk", str(cfg["chunk"])]  # fmt: skip
    command = [sys.executable, str(ROOT / "bench/serve_trace.py"), "serve", "--model", cfg["preset"], "--device",
               device, "--port", str(port), "--max-seqs", str(cfg["max_seqs"]), "--capacity", str(cfg["capacity"]),
               "--max-step-tokens", str(cfg["budget"]), "--prefill-chunk", str(cfg["chunk"]),
               "--max-waiting", "100000", "--log-level", "warning"]  # fmt: skip
    return command + (["--threads", "1"] if device == "cpu" else [])


def http_side(cfg: dict, device: str, runs: list[tuple], log: Path) -> list[dict]:
    proc, port = serve_client.start_server(lambda port: _server_command(cfg, device, port), log)
    try:
        if cfg["preset"] != "standin":
            prompts, outputs = warmup_burst(cfg, cfg["vocab"])
            _http_run(port, prompts, outputs, [0.0] * len(prompts), 600)
        results = []
        for (prompts, outputs, arrivals), rate in zip(runs, cfg["rates"], strict=True):
            results.append({"rate": rate, **_http_run(port, prompts, outputs, arrivals, cfg["rate_timeout_s"])})
            r = results[-1]
            print(f"http    rate {rate:.1f}: {r['tokens_per_s']:.0f} tok/s, TTFT p50 {r['ttft_p50_ms']:.1f} ms, "
                  f"HTTP path p50 {r['hops_ms'].get('http_path', {}).get('p50', float('nan')):.2f} ms, "
                  f"incomplete {r['incomplete']}", flush=True)  # fmt: skip
        return results
    finally:
        proc.terminate()
        proc.wait(60)


def ttft_cost(engine: list[float | None], http: list[float | None]) -> dict:
    """Per-request TTFT differences (HTTP - engine, ms): p50, p90, mean, bootstrap 90% intervals of p50 and mean."""
    diffs = np.asarray([h - e for e, h in zip(engine, http, strict=True) if e is not None and h is not None])
    if not len(diffs):
        return {"pairs": 0}
    samples = np.random.default_rng(0).choice(diffs, (2000, len(diffs)))
    medians, means = np.median(samples, axis=1), samples.mean(axis=1)
    return {"pairs": len(diffs), "p50": float(np.median(diffs)), "p90": float(np.percentile(diffs, 90)),
            "mean": float(diffs.mean()), "p50_ci90": np.percentile(medians, [5, 95]).tolist(),
            "mean_ci90": np.percentile(means, [5, 95]).tolist()}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/serve-http-h200.json")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--small", action="store_true", help="tiny preset on the CPU: a smoke test")
    mode.add_argument("--standin", action="store_true", help="bench/serve_standin.py's engine on the CPU")
    ap.add_argument("--host-ms", type=float, help="stand-in: GIL-holding plan per step (3)")
    ap.add_argument("--device-ms", type=float, help="stand-in: GIL-free device time per step (9)")
    ap.add_argument("--rates", type=float, nargs=3, help="arrival rates, requests/s (default: the preset's)")
    ap.add_argument("--window-s", type=float, help="arrivals per rate = rate x this (default: the preset's)")
    args = ap.parse_args()
    nan = float("nan")
    cfg = dict(SMALL if args.small else STANDIN if args.standin else FULL)
    for key in ("rates", "window_s", "host_ms", "device_ms"):
        if getattr(args, key) is not None:
            cfg[key] = tuple(args.rates) if key == "rates" else getattr(args, key)
    device = "cuda" if torch.cuda.is_available() and not (args.small or args.standin) else "cpu"
    if device == "cpu":
        torch.set_num_threads(1)
    if not args.standin:
        from batchkv.models import preset_config

        cfg["vocab"] = preset_config(cfg["preset"]).vocab
    cfg["capacity"] = cfg["prompt"][1] + cfg["output"][1]
    cfg["client"] = CLIENT
    runs = [workload(cfg, rate, cfg["vocab"], seed=i) for i, rate in enumerate(cfg["rates"])]
    start = time.perf_counter()
    engine = engine_side(cfg, device, runs)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    http = http_side(cfg, device, runs, out.with_suffix(".server.log"))
    rows = []
    for e, h in zip(engine, http, strict=True):
        cost = 100 * (1 - h["tokens_per_s"] / e["tokens_per_s"])
        rows.append({"rate": h["rate"], "engine": e, "http": h, "throughput_cost_pct": cost,
                     "http_path_ms": h["hops_ms"].get("http_path", {}),
                     "ttft_p50_cost_ms": h["ttft_p50_ms"] - e["ttft_p50_ms"],
                     "ttft_cost_ms": ttft_cost(e["ttft_ms_by_request"], h["ttft_ms_by_request"])})  # fmt: skip
        c, path = rows[-1]["ttft_cost_ms"], rows[-1]["http_path_ms"]
        above = c.get("mean_ci90", [-np.inf])[0] > path.get("p50", np.inf)  # HTTP slowed the engine's steps
        rows[-1]["judged_ttft_ms"] = c["mean"] if above else path.get("p50")
        print(f"rate {h['rate']:.1f}: HTTP costs {cost:.1f}% throughput and {rows[-1]['judged_ttft_ms'] or nan:.2f} "
              f"ms TTFT (judged); HTTP path p50 {path.get('p50', nan):.2f} "
              f"ms (p90 {path.get('p90', nan):.2f}); TTFT per request: mean {c.get('mean', nan):+.2f} ms "
              f"(90% interval {c.get('mean_ci90', [nan])[0]:+.2f}..{c.get('mean_ci90', [nan, nan])[1]:+.2f}), "
              f"p50 {c.get('p50', nan):+.2f}, p90 {c.get('p90', nan):+.2f}; difference of p50s "
              f"{rows[-1]['ttft_p50_cost_ms']:+.2f} ms", flush=True)  # fmt: skip
    result = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "config": dict(cfg),
        "target": "HTTP costs <= 5% throughput and <= 2 ms p50 TTFT against the in-process engine",
        "judged_on": "throughput_cost_pct and judged_ttft_ms (http_path_ms.p50, or ttft_cost_ms.mean when its "
        "90% interval lies above that; see bench/serve_http.py)",
        "rates": rows,
        "wall_s": time.perf_counter() - start,
    }
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out} in {result['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
