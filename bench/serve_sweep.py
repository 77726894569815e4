"""The prefill budget and overlap, swept on the 8B serving workload: throughput against latency.

Each cell serves the whole workload of bench/serve_profile.py (256 requests, prompts U[64, 2048],
outputs U[64, 1024], 64 sequences, chunk 512, step budget 1024, graphs) on a fresh engine with one
`prefill_budget` (most prompt tokens per step while samples run) and overlap on or off, and reports output tokens/s
(wall clock), inter-token and first-token p50/p99, steps, step time and occupancy. A smaller budget
keeps steps short while prompts stream in (inter-token p99) and spreads each prompt over more steps
(first token later); a larger one finishes prompts sooner in longer steps. JSON after each cell;
cells past `--budget-s` are skipped and listed. `--online-rate R` adds, per budget, a warmed engine
serving Poisson arrivals at R requests/s, with time to first token also in units of a full-chunk
step (`bench/decode.py`'s `full_chunk_step_ms`, measured on the same engine).

    python3 bench/serve_sweep.py --out bench/results/serve-sweep-h200.json      # H200, about 4 min
    python bench/serve_sweep.py --preset sensenova-u1-tiny --small --out /tmp/s.json   # CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from decode import full_chunk_step_ms, warm_up
from online import poisson_arrivals, run_online
from serve_profile import release, serve_workload, serving_engine, sync

from batchkv.models import build_model, preset_config

KEEP = ("generated_tokens", "steps", "step_ms_mean", "step_ms_p50", "step_ms_p99", "itl_ms_p50", "itl_ms_p99",
        "ttft_ms_p50", "ttft_ms_p99", "occupancy", "prefill_fraction", "padded_tokens", "captures",
        "growths")  # fmt: skip


def serve_cell(model, device, requests, args, budget: int | None, overlap: bool) -> dict:
    engine = serving_engine(
        model, device, requests, max_seqs=args.max_seqs, chunk=args.chunk, budget=args.budget, overlap=overlap,
        prefill_budget=budget,
    )  # fmt: skip
    for request in requests:
        engine.submit(request)
    sync(device)
    start = time.perf_counter()
    engine.run_until_done()
    sync(device)
    wall = time.perf_counter() - start
    summary = engine.metrics.summary()
    prefill_budget_used = engine.scheduler.prefill_budget
    del engine
    release(device)
    return {"prefill_budget": budget, "prefill_budget_used": prefill_budget_used, "overlap": overlap, "wall_s": wall,
            "tokens_per_s": summary["generated_tokens"] / wall, **{k: summary[k] for k in KEEP}}  # fmt: skip


def online_cell(model, device, requests, args, budget: int | None) -> dict:
    """A fresh engine with one `prefill_budget`, warmed, serving Poisson arrivals at `--online-rate`
    (seed 1, `--online-window-s` of arrivals, as bench/decode.py's medium rate); TTFT also in units
    of `full_chunk_step_ms` measured on the same engine."""
    engine = serving_engine(
        model, device, requests, max_seqs=args.max_seqs, chunk=args.chunk, budget=args.budget, overlap=True,
        prefill_budget=budget,
    )  # fmt: skip
    prompts = [r.prompt_ids for r in requests]
    outputs = [r.params.max_new_tokens for r in requests]
    warm_up(engine, device, prompts, outputs)
    unit = full_chunk_step_ms(engine, device, prompts)
    n = int(min(len(prompts), max(4, round(args.online_rate * args.online_window_s))))
    row = run_online(engine, prompts[:n], outputs[:n], poisson_arrivals(n, args.online_rate, seed=1))
    row["prefill_budget_used"] = engine.scheduler.prefill_budget
    del engine
    release(device)
    return {"prefill_budget": budget, "online_rate": args.online_rate, "full_chunk_step_ms": unit,
            "ttft_p50_in_full_chunk_steps": row["ttft_p50_ms"] / unit, **row}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/serve-sweep-h200.json")
    ap.add_argument("--preset", default="sensenova-u1-8b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="tiny sizes for a smoke test")
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--max-seqs", type=int, default=64)
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk per sequence")
    ap.add_argument("--budget", type=int, default=1024, help="max_step_tokens")
    ap.add_argument("--prefill-budgets", default="256,512,1024", help="comma list; 0 means None (the default)")
    ap.add_argument("--off-budgets", default="1024", help="budgets also run with overlap off (comma list, or empty)")
    ap.add_argument("--budget-s", type=float, default=480.0, help="skip cells that would start after this")
    ap.add_argument("--online-rate", type=float, default=0.0, help="req/s: also serve arrivals per budget (0: no)")
    ap.add_argument("--online-window-s", type=float, default=12.0, help="seconds of arrivals per online cell")
    ap.add_argument("--online-only", action="store_true", help="skip the offline cells")
    args = ap.parse_args()
    budgets = [int(b) or None for b in args.prefill_budgets.split(",") if b]
    off = [int(b) or None for b in args.off_budgets.split(",") if b]
    if args.small:
        args.requests, args.max_seqs, args.chunk, args.budget = 16, 8, 32, 64
        budgets, off = [16, None], [None]
        args.online_window_s = min(args.online_window_s, 2.0)
    device = torch.device(args.device)
    prompt, output = ((8, 64), (8, 48)) if args.small else ((64, 2048), (64, 1024))
    requests = serve_workload(args.requests, prompt, output, preset_config(args.preset).vocab)
    began = time.perf_counter()
    model = build_model(args.preset, device, seed=0)
    result: dict = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "preset": args.preset,
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "device")},
        "cells": [],
        "skipped": [],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    cells = [] if args.online_only else [(b, True) for b in budgets] + [(b, False) for b in off]
    for budget in budgets if args.online_rate > 0 else []:
        if time.perf_counter() - began > args.budget_s:
            result["skipped"].append({"prefill_budget": budget, "online_rate": args.online_rate})
            continue
        r = online_cell(model, device, requests, args, budget)
        result.setdefault("online", []).append(r)
        print(f"online {args.online_rate} req/s, prefill_budget {budget}: ttft p50 {r['ttft_p50_ms']:.0f} ms "
              f"({r['ttft_p50_in_full_chunk_steps']:.2f} full-chunk steps of {r['full_chunk_step_ms']:.1f} ms), "
              f"itl p50/p99 {r['itl_p50_ms']:.1f}/{r['itl_p99_ms']:.1f} ms", flush=True)  # fmt: skip
        out.write_text(json.dumps(result, indent=2) + "\n")
    for budget, overlap in cells:
        if time.perf_counter() - began > args.budget_s:
            result["skipped"].append({"prefill_budget": budget, "overlap": overlap})
            continue
        r = serve_cell(model, device, requests, args, budget, overlap)
        result["cells"].append(r)
        print(
            f"prefill_budget {budget} overlap {'on' if overlap else 'off'}: {r['tokens_per_s']:.0f} tok/s, "
            f"itl p50/p99 {r['itl_ms_p50']:.1f}/{r['itl_ms_p99']:.1f} ms, ttft p50/p99 {r['ttft_ms_p50']:.0f}/"
            f"{r['ttft_ms_p99']:.0f} ms, {r['steps']} steps of {r['step_ms_mean']:.2f} ms",
            flush=True,
        )
        out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
