"""Engine replicas on Ray Serve (`batchkv.cli.ray`): the router's prefix hits, and two replicas
against one.

`routing`: two replicas of the tiny preset on the CPU, a shared-prefix workload (16 prefixes of 64
tokens, 8 requests each with a 16-token tail of its own, 4 tokens out, in a shuffled order, 8 at a
time), routed once by batchkv's `PrefixAffinityRouter` and once by Ray's default router (power of
two choices). What counts is each replica's prefix cache: requests that reused a prefix (hit rate),
prompt positions reused, and so the prompt tokens computed. Each replica holds 16 columns, so its
store keeps about 16 finished histories: affinity gives each replica half of the prefixes, the
power-of-two router all of them on both.

`scale`: the standard serving workload of bench/serve_http.py (prompts U[64, 2048], outputs
U[64, 1024], greedy to their length, Poisson arrivals at three rates; `--small`: the tiny preset's
U[8, 48] / U[8, 32]) against one replica and against two, streamed over HTTP by
bench/lib/serve_client.py: output tokens/s, TTFT and inter-token latency. On the CPU both replicas
share the same cores, so it is a smoke run; the GPU run gives each replica its own GPU (needs a
two-GPU host):
    python bench/replicas.py routing --out bench/results/replicas-routing-cpu.json
    python bench/replicas.py scale --small --out /tmp/replicas-scale-cpu.json
    python bench/replicas.py scale --device cuda --out /tmp/replicas-scale-h200x2.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's batchkv

from bench.lib import serve_client
from bench.lib.online import poisson_arrivals

FULL = {"preset": "sensenova-u1-8b", "prompt": (64, 2048), "output": (64, 1024), "rates": (1.0, 2.0, 4.0),
        "window_s": 20.0, "timeout_s": 60.0, "max_seqs": 64, "capacity": 4096}  # fmt: skip
SMALL = {"preset": "sensenova-u1-tiny", "prompt": (8, 48), "output": (8, 32), "rates": (4.0, 8.0, 16.0),
         "window_s": 1.5, "timeout_s": 60.0, "max_seqs": 8, "capacity": 256}  # fmt: skip
ROUTING = {"prefixes": 16, "prefix_len": 64, "per_prefix": 8, "tail": 16, "out": 4, "parallel": 8}


def deploy(options: dict, *, prefix_affinity: bool = True) -> int:
    """Run the application on the local cluster; returns its HTTP port."""
    from ray import serve

    from batchkv.cli.ray import APP, application, parser
    from tests.serve_helpers import free_port

    argv = list(itertools.chain.from_iterable((f"--{k}", str(v)) for k, v in options.items()))
    args = parser().parse_args(argv)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(application(args, prefix_affinity=prefix_affinity), name=APP, route_prefix="/")
    return port


def undeploy() -> None:
    from ray import serve

    serve.shutdown()  # the HTTP proxy too: the next deploy starts on a new port


def counters() -> dict[str, int]:
    from batchkv.cli.ray import replica_stats

    stats = replica_stats().values()
    return {key: sum(s[key] for s in stats) for key in ("prefix_admitted", "prefix_hits", "prefix_reused",
                                                         "prefix_evictions")}  # fmt: skip


# ---- routing -----------------------------------------------------------------------------------
def routing_workload(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    w = ROUTING
    prefixes = [[rng.randrange(1, 500) for _ in range(w["prefix_len"])] for _ in range(w["prefixes"])]
    prompts = [p + [rng.randrange(1, 500) for _ in range(w["tail"])] for p in prefixes for _ in range(w["per_prefix"])]
    rng.shuffle(prompts)
    return prompts


def routing_run(port: int, prompts: list[list[int]]) -> dict:
    import httpx

    def send(prompt: list[int]) -> int:
        body = {"prompt": prompt, "max_tokens": ROUTING["out"], "temperature": 0, "ignore_eos": True}
        return httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120).status_code

    before = counters()
    start = time.perf_counter()
    with ThreadPoolExecutor(ROUTING["parallel"]) as pool:
        codes = list(pool.map(send, prompts))
    wall = time.perf_counter() - start
    after = counters()
    d = {k: after[k] - before[k] for k in after}
    prompt_tokens = sum(len(p) for p in prompts)
    return {"requests": len(prompts), "errors": sum(c != 200 for c in codes), "admitted": d["prefix_admitted"],
            "hits": d["prefix_hits"], "hit_rate": d["prefix_hits"] / max(d["prefix_admitted"], 1),
            "reused_tokens": d["prefix_reused"], "prompt_tokens": prompt_tokens,
            "computed_prompt_tokens": prompt_tokens - d["prefix_reused"], "evictions": d["prefix_evictions"],
            "prefixes_held_by": holders(prompts), "wall_s": wall}  # fmt: skip


def holders(prompts: list[list[int]]) -> dict[str, int]:
    """How many prefixes each number of replicas holds at the end (their first block in its index)."""
    from batchkv.cli.ray import replica_stats
    from batchkv.executor.prefix import block_hashes

    indexes = [set(s["blocks"]) for s in replica_stats().values()]
    firsts = {block_hashes(p[: ROUTING["prefix_len"]])[0] for p in prompts}
    counts = [sum(block in index for index in indexes) for block in firsts]
    return {str(n): counts.count(n) for n in range(len(indexes) + 1)}


def routing(args: argparse.Namespace) -> dict:
    options = {"model": "sensenova-u1-tiny", "device": "cpu", "ray-replicas": 2, "max-seqs": 16,
               "capacity": 256, "prefill-chunk": 16, "threads": 1}  # fmt: skip
    prompts = routing_workload()
    out = {}
    for name, affinity in (("prefix_affinity", True), ("power_of_two", False)):
        port = deploy(options, prefix_affinity=affinity)
        try:
            out[name] = routing_run(port, prompts)
        finally:
            undeploy()
        r = out[name]
        print(f"{name:16s} hit rate {r['hit_rate']:.3f} ({r['hits']}/{r['admitted']}), prompt tokens computed "
              f"{r['computed_prompt_tokens']} of {r['prompt_tokens']}, {r['wall_s']:.1f} s", flush=True)  # fmt: skip
    return {"workload": ROUTING, "engine": options, "routers": out}


# ---- scale -------------------------------------------------------------------------------------
def scale_workload(cfg: dict, rate: float, seed: int) -> tuple[list[list[int]], list[int], list[float]]:
    """bench/serve_http.py's workload: uniform prompt and output lengths, Poisson arrivals."""
    n = max(4, round(rate * cfg["window_s"]))
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, 500, int(rng.integers(cfg["prompt"][0], cfg["prompt"][1] + 1))).tolist()
               for _ in range(n)]  # fmt: skip
    outputs = [int(rng.integers(cfg["output"][0], cfg["output"][1] + 1)) for _ in range(n)]
    return prompts, outputs, poisson_arrivals(n, rate, seed=seed)


def scale_run(port: int, prompts, outputs, arrivals, timeout: float) -> dict:
    common = {"temperature": 0, "stream": True, "ignore_eos": True, "return_token_ids": True}
    pairs = zip(prompts, outputs, strict=True)
    bodies = [json.dumps({"prompt": p, "max_tokens": o, **common}).encode() for p, o in pairs]
    records = serve_client.run(port, "/v1/completions", bodies, arrivals, timeout)
    t0 = records[0]["due"] - arrivals[0]
    wall = max(max((r["times"][-1] for r in records if r["times"]), default=t0) - t0, 1e-9)
    ttft = [1e3 * (r["times"][0] - r["sent"]) for r in records if r["times"]]
    itl = [1e3 * (b - a) for r in records for a, b in itertools.pairwise(r["times"]) if b > a]
    tokens = sum(len(r["times"]) for r in records)
    p = lambda v, q: float(np.percentile(v, q)) if v else 0.0  # noqa: E731
    return {"requests": len(prompts), "incomplete": sum(r["incomplete"] for r in records), "tokens": tokens,
            "tokens_per_s": tokens / wall, "ttft_p50_ms": p(ttft, 50), "ttft_p99_ms": p(ttft, 99),
            "itl_p50_ms": p(itl, 50), "itl_p99_ms": p(itl, 99), "wall_s": wall}  # fmt: skip


def scale(args: argparse.Namespace) -> dict:
    cfg = SMALL if args.small else FULL
    options = {"model": cfg["preset"], "device": args.device, "max-seqs": cfg["max_seqs"], "capacity": cfg["capacity"]}
    if args.device == "cpu":
        options["threads"] = 1
    runs = [scale_workload(cfg, rate, seed) for seed, rate in enumerate(cfg["rates"])]
    out = {}
    for replicas in (1, 2):
        port = deploy({**options, "ray-replicas": replicas})
        try:
            out[str(replicas)] = [{"rate": rate, **scale_run(port, *run, cfg["timeout_s"])}
                                  for rate, run in zip(cfg["rates"], runs, strict=True)]  # fmt: skip
        finally:
            undeploy()
        for r in out[str(replicas)]:
            print(f"{replicas} replica(s), rate {r['rate']:.1f}: {r['tokens_per_s']:.0f} tok/s, TTFT p50 "
                  f"{r['ttft_p50_ms']:.1f} ms, ITL p50 {r['itl_p50_ms']:.1f} ms, incomplete {r['incomplete']}",
                  flush=True)  # fmt: skip
    return {"workload": {k: v for k, v in cfg.items()}, "engine": options, "replicas": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("routing", "scale"))
    ap.add_argument("--small", action="store_true", help="scale: the tiny preset's workload (CPU smoke run)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--cpus", type=int, default=4, help="CPUs the local Ray cluster offers (4)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    import ray

    ray.init(num_cpus=args.cpus, include_dashboard=False, log_to_driver=False)
    try:
        result = routing(args) if args.what == "routing" else scale(args)
    finally:
        ray.shutdown()
    result["machine"] = {"host": platform.node(), "cpu": platform.processor() or platform.machine(),
                         "ray": ray.__version__, "device": args.device}  # fmt: skip
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
