"""Where a serving step's time goes: GPU busy (the union of kernel intervals) against host-only gaps,
by kernel kind, with overlap on and off, on the 8B serving workload in steady state.

Workload (bench/decode.py's serving part): 256 requests, prompts U[64, 2048], outputs U[64, 1024],
seed 0, greedy; 64 sequences, prefill chunk 512, step budget 1024 (`--prefill-budget` caps the
prompt tokens of a step while samples run; default half the step), CUDA graphs, the store reserved
up front. Per mode, a fresh engine gets every request at once, runs `--warmup` steps (graphs
captured, every column busy), times `--steps` steps, then profiles as many more under
torch.profiler (CUDA activity only, so the host runs at its own speed). Reported per step: wall
time, GPU busy (union of kernel and copy intervals from the first to the last kernel of the
profiled steps), gap = wall - busy (the GPU waiting for the host), busy time by kernel kind and
name, and the gaps over 20 us (count, sum, largest); a capture during the profiled steps (a new
width) is counted in `captures_during_profile` and shows as a large gap.

    python3 bench/serve_profile.py --out bench/results/serve-profile-h200.json          # H200, < 2 min
    python bench/serve_profile.py --preset sensenova-u1-tiny --small --out /tmp/p.json   # CPU smoke test
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from step_profile import kind_of

from batchkv.executor import Engine, Request, SamplingParams
from batchkv.models import build_model, preset_config

KV_DTYPES = {"model": None, "fp8": torch.float8_e4m3fn}  # --kv-dtype: K/V storage
GAP_US = 20.0  # gaps between device intervals longer than this are listed


def serve_workload(n: int, prompt: tuple[int, int], output: tuple[int, int], vocab: int, seed: int = 0):
    """`n` greedy requests: prompts and max_new_tokens uniform in the inclusive ranges."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, vocab, rng.integers(prompt[0], prompt[1] + 1)).tolist() for _ in range(n)]
    outputs = rng.integers(output[0], output[1] + 1, n).tolist()
    return [Request(p, SamplingParams(max_new_tokens=o)) for p, o in zip(prompts, outputs, strict=True)]


def serving_engine(
    model, device, requests, *, max_seqs, chunk, budget, overlap, prefill_budget=None, kv_dtype=None
) -> Engine:
    """The serving engine of the workload: capacity for its longest request, the store reserved."""
    capacity = max(len(r.prompt_ids) for r in requests) + max(r.params.max_new_tokens for r in requests) + 1
    engine = Engine(
        model,
        max_seqs=max_seqs,
        capacity=capacity,
        max_step_tokens=budget,
        prefill_chunk=min(chunk, capacity, budget),
        prefill_budget=prefill_budget,
        device=device,
        overlap=overlap,
        kv_dtype=kv_dtype,
        # Allocated whole: no growth (and recapture) mid-run; past 64 sequences sized to the device,
        # as the README's serving configuration is (the uniform store of 256 columns does not fit).
        kv_positions=max_seqs * capacity if max_seqs <= 64 else "auto",
    )
    return engine


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release(device: torch.device) -> None:
    """Give a dropped engine's memory back before the next one is built."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def device_intervals(prof, device: torch.device) -> list[tuple[float, float, str, str]]:
    """(start us, end us, kind, name) of every kernel, copy and memset the profiler saw on the device.
    On the CPU (smoke tests) the top-level aten ops stand in for kernels."""
    out = []
    for event in prof.events():
        if device.type == "cuda":
            if event.device_type != torch.autograd.DeviceType.CUDA:
                continue
        elif event.cpu_parent is not None or not event.name.startswith("aten::"):
            continue
        name = event.name.lower()
        kind = "memcpy" if "memcpy" in name or "memset" in name else kind_of(event.name)
        out.append((event.time_range.start, event.time_range.end, kind, event.name[:80]))
    return sorted(out)


def split(intervals: list[tuple[float, float, str, str]], steps: int) -> dict:
    """GPU busy (union) against gaps over the span of `intervals`, per step, in ms; time by kernel
    kind and by name (the 12 largest)."""
    if not intervals:
        return {"device_events": 0}
    lo, hi = intervals[0][0], max(end for _, end, _, _ in intervals)
    busy, cursor, gaps = 0.0, lo, []
    by_kind: dict[str, float] = defaultdict(float)
    by_name: dict[str, float] = defaultdict(float)
    for start, end, kind, name in intervals:
        by_kind[kind] += end - start
        by_name[name] += end - start
        if start > cursor:
            gaps.append(start - cursor)
        busy += max(0.0, end - max(start, cursor))
        cursor = max(cursor, end)
    wall = hi - lo
    long = [g for g in gaps if g > GAP_US]
    return {
        "device_events": len(intervals),
        "wall_ms_per_step": wall / steps / 1e3,
        "gpu_busy_ms_per_step": busy / steps / 1e3,
        "gap_ms_per_step": (wall - busy) / steps / 1e3,
        "busy_fraction": busy / wall if wall else 0.0,
        "kernel_ms_per_step_by_kind": {k: v / steps / 1e3 for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "kernel_ms_per_step_by_name": {
            k: v / steps / 1e3 for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])[:12]
        },
        "gaps_over_20us": {
            "count": len(long),
            "ms_per_step": sum(long) / steps / 1e3,
            "largest_us": sorted(long, reverse=True)[:10],
        },
    }


def profile_mode(model, device, requests, args, overlap: bool) -> dict:
    engine = serving_engine(
        model, device, requests, max_seqs=args.max_seqs, chunk=args.chunk, budget=args.budget, overlap=overlap,
        prefill_budget=args.prefill_budget, kv_dtype=KV_DTYPES[args.kv_dtype],
    )  # fmt: skip
    for request in requests:
        engine.submit(request)
    for _ in range(args.warmup):
        engine.step()
    sync(device)
    start = time.perf_counter()
    before = engine.metrics.generated_tokens
    for _ in range(args.steps):
        engine.step()
    sync(device)
    timed = time.perf_counter() - start
    tokens = engine.metrics.generated_tokens - before
    captures = engine.metrics.captures
    activities = [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else []
    activities = activities or [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.steps):
            engine.step()
        sync(device)
    result = {
        "overlap": engine.overlap,
        "prefill_budget_used": engine.scheduler.prefill_budget,
        "graphs": engine.uses_graphs,
        "steps": args.steps,
        "running": engine.num_running,
        "waiting": engine.num_waiting,
        "unprofiled_ms_per_step": timed / args.steps * 1e3,
        "unprofiled_tokens_per_s": tokens / timed,
        "captures_during_profile": engine.metrics.captures - captures,
        **split(device_intervals(prof, device), args.steps),
    }
    for request_id in list(engine.scheduler.live):  # the rest of the workload is not measured
        engine.cancel(request_id)
    engine.run_until_done()  # finishes the step in flight
    del engine
    release(device)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/serve-profile-h200.json")
    ap.add_argument("--preset", default="sensenova-u1-8b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="tiny sizes for a smoke test")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--max-seqs", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk per sequence")
    ap.add_argument("--budget", type=int, default=1024, help="max_step_tokens")
    ap.add_argument("--prefill-budget", type=int, default=None, help="prompt tokens per step (default: the engine's)")
    ap.add_argument("--warmup", type=int, default=200, help="steps before timing (graphs captured, columns busy)")
    ap.add_argument("--steps", type=int, default=60, help="steps timed, then as many profiled")
    ap.add_argument("--modes", default="on,off", help="overlap modes to run, in order")
    ap.add_argument("--kv-dtype", choices=sorted(KV_DTYPES), default="model", help="K/V storage (fp8: e4m3)")
    args = ap.parse_args()
    if args.small:
        args.requests, args.max_seqs, args.chunk, args.budget, args.warmup, args.steps = 16, 8, 32, 64, 12, 8
    device = torch.device(args.device)
    prompt, output = ((8, 64), (8, 48)) if args.small else ((64, 2048), (64, 1024))
    requests = serve_workload(args.requests, prompt, output, preset_config(args.preset).vocab)
    model = build_model(args.preset, device, seed=0)
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "preset": args.preset,
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "device")},
        "modes": {},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for mode in args.modes.split(","):
        r = result["modes"][mode] = profile_mode(model, device, requests, args, overlap=mode == "on")
        print(
            f"overlap {mode}: {r['unprofiled_ms_per_step']:.2f} ms/step unprofiled, "
            f"{r['unprofiled_tokens_per_s']:.0f} tok/s; profiled: busy {r.get('gpu_busy_ms_per_step', 0):.2f} of "
            f"{r.get('wall_ms_per_step', 0):.2f} ms ({100 * r.get('busy_fraction', 0):.0f}%), "
            f"running {r['running']}",
            flush=True,
        )
        out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
