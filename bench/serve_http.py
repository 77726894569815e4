"""HTTP serving against the in-process engine: what `batchkv serve` costs at the same load.

The SenseNova-U1-8B preset (random weights, token-id prompts), prompts U[64, 2048] and outputs
U[64, 1024] tokens (greedy, no stop: every request runs to its length), Poisson arrivals at three
rates. For each rate the same requests go (1) straight into an `Engine` through
`bench.online.run_online`, then (2) over HTTP to a `batchkv serve` subprocess with the same engine
settings, streamed (`stream: true`) and timed by the client: TTFT from sending the request to the
first token event, inter-token latency between token events, throughput = output tokens / wall.
Both sides warm up first on the same burst (graph captures, storage growth to capacity).
Target: HTTP costs <= 5% throughput and <= 2 ms p50 TTFT.

On the H200 (needs the serve wheels in .whl/, see bench/results/README.md; about 3.5 minutes):
    OUT=/tmp/out bash bench/gpu_session.sh serve
CPU smoke test (tiny preset, seconds):
    python bench/serve_http.py --small --out /tmp/serve-http-smoke.json
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from batchkv.executor import Engine, Request, SamplingParams
from batchkv.models import build_model
from bench.online import poisson_arrivals, run_online

FULL = {"preset": "sensenova-u1-8b", "prompt": (64, 2048), "output": (64, 1024), "rates": (1.0, 2.0, 4.0),
        "window_s": 10.0, "rate_timeout_s": 40.0, "max_seqs": 64, "budget": 1024, "chunk": 512}  # fmt: skip
SMALL = {"preset": "sensenova-u1-tiny", "prompt": (8, 48), "output": (8, 32), "rates": (4.0, 8.0, 16.0),
         "window_s": 1.5, "rate_timeout_s": 30.0, "max_seqs": 8, "budget": 64, "chunk": 32}  # fmt: skip


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
    model = build_model(cfg["preset"], device, seed=0)
    engine = Engine(model, max_seqs=cfg["max_seqs"], capacity=cfg["capacity"], max_step_tokens=cfg["budget"],
                    prefill_chunk=cfg["chunk"], device=device)  # fmt: skip
    for prompt, output in zip(*warmup_burst(cfg, engine.vocab_size), strict=True):
        engine.submit(Request(prompt, SamplingParams(max_new_tokens=output)))
    engine.run_until_done()
    results = []
    for prompts, outputs, arrivals in runs:
        results.append(run_online(engine, prompts, outputs, arrivals))
        print(f"engine  rate {results[-1]['rate']:.1f}: {results[-1]['tokens_per_s']:.0f} tok/s, "
              f"TTFT p50 {results[-1]['ttft_p50_ms']:.1f} ms", flush=True)  # fmt: skip
    del engine, model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return results


# ---- over HTTP ---------------------------------------------------------------------------------
async def _one(client, url: str, prompt: list[int], output: int, delay: float, t0: float, rec: dict) -> None:
    import httpx

    await asyncio.sleep(max(0.0, t0 + delay - time.perf_counter()))
    body = {"prompt": prompt, "max_tokens": output, "temperature": 0, "stream": True, "ignore_eos": True}
    sent = time.perf_counter()
    times: list[float] = []
    try:
        async with client.stream("POST", url, json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    now = time.perf_counter()
                    tokens = len(json.loads(line[6:])["choices"][0].get("token_ids", ()))
                    times += [now] * tokens
    except (httpx.HTTPError, asyncio.CancelledError):
        rec["incomplete"] += 1
    rec["tokens"] += len(times)
    rec["end"] = max(rec["end"], times[-1] if times else sent)
    if times:
        rec["ttft"].append(times[0] - sent)
        rec["itl"] += [b - a for a, b in itertools.pairwise(times) if b > a]


async def _http_run(url: str, prompts, outputs, arrivals, timeout: float) -> dict:
    import httpx

    rec = {"tokens": 0, "ttft": [], "itl": [], "end": 0.0, "incomplete": 0}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        t0 = time.perf_counter()
        tasks = [asyncio.ensure_future(_one(client, url, p, o, a, t0, rec))
                 for p, o, a in zip(prompts, outputs, arrivals, strict=True)]  # fmt: skip
        _, pending = await asyncio.wait(tasks, timeout=timeout)
        for task in pending:  # time-boxed: what is left is cancelled and counted
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    wall = max(rec["end"] - t0, 1e-9)
    (t50, t99), (i50, i99) = _percentiles(rec["ttft"]), _percentiles(rec["itl"])
    return {"requests": len(prompts), "incomplete": rec["incomplete"], "tokens": rec["tokens"],
            "tokens_per_s": rec["tokens"] / wall, "ttft_p50_ms": 1e3 * t50, "ttft_p99_ms": 1e3 * t99,
            "itl_p50_ms": 1e3 * i50, "itl_p99_ms": 1e3 * i99, "wall_s": wall}  # fmt: skip


def http_side(cfg: dict, device: str, runs: list[tuple], log: Path) -> list[dict]:
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "batchkv.cli", "serve", "--model", cfg["preset"], "--device", device,
               "--port", str(port), "--max-seqs", str(cfg["max_seqs"]), "--capacity", str(cfg["capacity"]),
               "--max-step-tokens", str(cfg["budget"]), "--prefill-chunk", str(cfg["chunk"]),
               "--max-waiting", "100000", "--log-level", "warning"]  # fmt: skip
    if device == "cpu":
        command += ["--threads", "1"]
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"batchkv serve did not start; see {log}")
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        url = base + "/v1/completions"
        prompts, outputs = warmup_burst(cfg, cfg["vocab"])
        asyncio.run(_http_run(url, prompts, outputs, [0.0] * len(prompts), 600))
        results = []
        for (prompts, outputs, arrivals), rate in zip(runs, cfg["rates"], strict=True):
            result = {"rate": rate, **asyncio.run(_http_run(url, prompts, outputs, arrivals, cfg["rate_timeout_s"]))}
            results.append(result)
            print(f"http    rate {rate:.1f}: {result['tokens_per_s']:.0f} tok/s, TTFT p50 {result['ttft_p50_ms']:.1f} "
                  f"ms, incomplete {result['incomplete']}", flush=True)  # fmt: skip
        return results
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/serve-http-h200.json")
    ap.add_argument("--small", action="store_true", help="tiny preset on the CPU: a smoke test")
    ap.add_argument("--rates", type=float, nargs=3, help="arrival rates, requests/s (default: the preset's)")
    args = ap.parse_args()
    cfg = dict(SMALL if args.small else FULL)
    if args.rates:
        cfg["rates"] = tuple(args.rates)
    device = "cuda" if torch.cuda.is_available() and not args.small else "cpu"
    if device == "cpu":
        torch.set_num_threads(1)
    from batchkv.models import preset_config

    cfg["vocab"] = preset_config(cfg["preset"]).vocab
    cfg["capacity"] = cfg["prompt"][1] + cfg["output"][1]
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
                     "ttft_p50_cost_ms": h["ttft_p50_ms"] - e["ttft_p50_ms"]})  # fmt: skip
        print(f"rate {h['rate']:.1f}: HTTP costs {rows[-1]['throughput_cost_pct']:.1f}% throughput, "
              f"{rows[-1]['ttft_p50_cost_ms']:+.2f} ms p50 TTFT", flush=True)  # fmt: skip
    result = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "config": {k: v for k, v in cfg.items()},
        "target": "HTTP costs <= 5% throughput and <= 2 ms p50 TTFT against the in-process engine",
        "rates": rows,
        "wall_s": time.perf_counter() - start,
    }
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out} in {result['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
