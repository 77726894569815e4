"""A long-context mix on one engine: does the store's memory follow each request's reach?

An engine allowing 32,768-token requests (the SenseNova-U1-8B preset, random bf16 weights, 256
sequences, the store sized to the device: `kv_positions="auto"`, 1,024-token steps, 512-token
chunks, graphs and overlap on) is fed, all at once, 16 requests with prompts of U[16k, 30k] tokens
and 240 requests drawn as bench/decode.py draws its serving workload (prompts U[64, 2048], outputs
U[64, 1024], seed 0), the long ones spread through the queue (seed 1). Reported:
- resident_max: the most requests holding columns at once;
- store_over_reach: the store's bytes over the bytes of what the resident requests can reach
  (prompt + max_new_tokens - 1 positions each), when the resident requests reach the most (the store
  at its fullest); a uniform store of 32,768-row columns would be capacity / mean reach;
- short_vs_alone: the 240 short requests' output tokens/s (their tokens over the time their last
  one finished) against the same 240 served alone by an engine sized for them (capacity their
  longest reach), in the same run;
- long_at_priority_1: the mix once more with the long requests at `Request.priority` 1 (paused
  while any short one holds a column): the short requests' short_vs_alone then, and when the long
  ones finish.

    python3 bench/long_context.py --out bench/results/long-context-h200.json   # on the H200
    python bench/long_context.py --small --out /tmp/lc.json                      # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from decode import sync, workload

from batchkv.executor import Engine, Request, SamplingParams
from batchkv.models import build_model, preset_config


def mix(vocab: int, small: bool) -> tuple[list[list[int]], list[int], list[bool]]:
    """Prompts, outputs and which requests are long, in submission order."""
    n_long, n_short = (2, 12) if small else (16, 240)
    long_range, cap = ((200, 400), 512) if small else ((16_384, 30_000), 32_768)
    short_p, short_o = workload(n_short, *(((8, 64), (4, 32)) if small else ((64, 2048), (64, 1024))), vocab)
    rng = np.random.default_rng(1)
    long_p = [rng.integers(0, vocab, rng.integers(*long_range)).tolist() for _ in range(n_long)]
    long_o = [int(min(o, cap - len(p))) for p, o in zip(long_p, rng.integers(64, 1025, n_long), strict=True)]
    order = rng.permutation(n_long + n_short).tolist()
    prompts, outputs = [*long_p, *short_p], [*long_o, *short_o]
    return [prompts[i] for i in order], [outputs[i] for i in order], [i < n_long for i in order]


def serve(engine: Engine, prompts, outputs, device, priorities=None) -> dict:
    """Submit everything at once and step to the end, sampling residency after every step."""
    priorities = priorities or [0] * len(prompts)
    ids = [engine.submit(Request(p, SamplingParams(max_new_tokens=o), priority=q))
           for p, o, q in zip(prompts, outputs, priorities, strict=True)]  # fmt: skip
    reach = {rid: min(engine.cache.capacity, len(p) + o - 1) for rid, p, o in zip(ids, prompts, outputs, strict=True)}
    done_at: dict[int, float] = {}
    tokens: dict[int, int] = dict.fromkeys(ids, 0)
    resident_max = reach_max = steps = 0
    sync(device)
    start = time.perf_counter()
    while engine.has_work:
        if steps > 1_000_000:
            raise RuntimeError("the engine made no end of a finite workload in a million steps")
        steps += 1
        if steps % 500 == 0:
            print(f"  step {steps} at {time.perf_counter() - start:.1f} s: {len(done_at)} done, "
                  f"{len(engine.cache.sequences)} columns held, {engine.num_waiting} waiting", flush=True)  # fmt: skip
        for event in engine.step():
            if event.token is not None:
                tokens[event.request_id] += 1
            if event.finish_reason is not None:
                done_at[event.request_id] = time.perf_counter() - start
        live = [rid for rid, state in engine.scheduler.live.items() if state.samples[0].seq >= 0]
        resident_max = max(resident_max, len(live))
        reach_max = max(reach_max, sum(reach[rid] for rid in live))
    sync(device)
    wall = time.perf_counter() - start
    return {"ids": ids, "done_at": done_at, "tokens": tokens, "resident_max": resident_max,
            "reach_max_positions": reach_max, "wall_s": wall}  # fmt: skip


def engine_for(model, device, capacity: int, small: bool) -> Engine:
    """The serving engine; a smoke run's store holds 1,200 positions, less than its mix reaches."""
    return Engine(model, max_seqs=256, kv_positions=max(1200, capacity) if small else "auto", capacity=capacity,
                  max_step_tokens=64 if small else 1024, prefill_chunk=32 if small else 512, device=device)  # fmt: skip


def warm(engine: Engine, prompts, device) -> None:
    """Graphs captured and kernels compiled outside the timed run: a short pass over some prompts."""
    for p in prompts[:64]:
        engine.submit(Request(p[:512], SamplingParams(max_new_tokens=8)))
    engine.run_until_done()
    engine.clear_prefix_cache()  # the timed run reuses no prefix of this pass
    engine.warm_up()  # every width's graph, so that no timed step captures one
    sync(device)
    engine.metrics = engine.metrics.fresh()


def short_rate(run: dict, short_ids: list[int]) -> float:
    return sum(run["tokens"][i] for i in short_ids) / max(run["done_at"][i] for i in short_ids)


def priority_run(engine: Engine, prompts, outputs, is_long, device) -> dict:
    """The mix again on the same warm engine, the long requests at priority 1 (`Request.priority`:
    paused while a short one holds a column), with what that costs them."""
    engine.clear_prefix_cache()
    engine.metrics = engine.metrics.fresh()
    run = serve(engine, prompts, outputs, device, [int(long) for long in is_long])
    short_ids = [rid for rid, long in zip(run["ids"], is_long, strict=True) if not long]
    long_ids = [rid for rid, long in zip(run["ids"], is_long, strict=True) if long]
    return {"wall_s": run["wall_s"], "resident_max": run["resident_max"],
            "tokens_per_s": sum(run["tokens"].values()) / run["wall_s"],
            "short_tokens_per_s": short_rate(run, short_ids),
            "short_last_done_s": max(run["done_at"][i] for i in short_ids),
            "long_first_done_s": min(run["done_at"][i] for i in long_ids),
            "long_last_done_s": max(run["done_at"][i] for i in long_ids),
            "long_tokens_per_s": short_rate(run, long_ids), "summary": engine.metrics.summary()}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench/results/long-context-h200.json"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="tiny model and workload: a smoke run")
    args = ap.parse_args()
    device = torch.device(args.device)
    preset = "sensenova-u1-tiny" if args.small else "sensenova-u1-8b"
    model = build_model(preset, device, seed=0)
    prompts, outputs, is_long = mix(preset_config(preset).vocab, args.small)
    capacity = 512 if args.small else 32_768
    result: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "preset": preset,
                    "long_requests": sum(is_long), "short_requests": len(is_long) - sum(is_long),
                    "capacity": capacity}  # fmt: skip

    engine = engine_for(model, device, capacity, args.small)
    warm(engine, prompts, device)
    mixed = serve(engine, prompts, outputs, device)
    per_position = engine.cache.config.bytes_per_position()
    store = engine.cache.nbytes
    short_ids = [rid for rid, long in zip(mixed["ids"], is_long, strict=True) if not long]
    reaches = [min(capacity, len(p) + o - 1) for p, o in zip(prompts, outputs, strict=True)]
    result["mixed"] = {
        "sizing": engine.sizing.describe() if engine.sizing else None, "store_bytes": store,
        "pool_positions": engine.cache.pool_rows - engine.cache.config.scratch_rows,
        "resident_max": mixed["resident_max"], "reach_max_positions": mixed["reach_max_positions"],
        "wall_s": mixed["wall_s"], "tokens_per_s": sum(mixed["tokens"].values()) / mixed["wall_s"],
        "short_tokens_per_s": short_rate(mixed, short_ids), "summary": engine.metrics.summary(),
        "uniform_store_over_reach": capacity * len(reaches) / sum(reaches),
    }  # fmt: skip
    result["resident_max"] = mixed["resident_max"]
    result["store_over_reach"] = store / (mixed["reach_max_positions"] * per_position)
    result["long_at_priority_1"] = priority_run(engine, prompts, outputs, is_long, device)
    engine.close()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")  # the mixed run, in case the rest is cut short
    print(f"mixed: {json.dumps({k: v for k, v in result['mixed'].items() if k != 'summary'})}", flush=True)

    short = [(p, o) for p, o, long in zip(prompts, outputs, is_long, strict=True) if not long]
    alone_capacity = max(len(p) + o for p, o in short)
    engine = engine_for(model, device, alone_capacity, args.small)
    warm(engine, [p for p, _ in short], device)
    alone = serve(engine, [p for p, _ in short], [o for _, o in short], device)
    result["alone"] = {"capacity": alone_capacity, "wall_s": alone["wall_s"],
                       "sizing": engine.sizing.describe() if engine.sizing else None,
                       "resident_max": alone["resident_max"], "short_tokens_per_s": short_rate(alone, alone["ids"]),
                       "summary": engine.metrics.summary()}  # fmt: skip
    engine.close()
    result["short_vs_alone"] = result["mixed"]["short_tokens_per_s"] / result["alone"]["short_tokens_per_s"]
    lowered = result["long_at_priority_1"]
    lowered["short_vs_alone"] = lowered["short_tokens_per_s"] / result["alone"]["short_tokens_per_s"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"resident_max {result['resident_max']}, store_over_reach {result['store_over_reach']:.3f}, "
        f"short_vs_alone {result['short_vs_alone']:.3f} ({lowered['short_vs_alone']:.3f} with the long ones at "
        f"priority 1, which then finish at {lowered['long_last_done_s']:.1f} s against {result['mixed']['wall_s']:.1f})"
    )


if __name__ == "__main__":
    main()
