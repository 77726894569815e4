"""The prefix cache on three workloads, each with the cache off and on in the same run.

SenseNova-U1-8B preset, random bf16 weights, the README's serving configuration (`max_seqs="auto"`:
256 sequences, the store sized to the device; 1,024-token steps, 512-token chunks, graphs and
overlap on), one engine per setting, warmed up before it is timed (bench/lib/serving.py `WARM_UP`):
- shared_prefix: 256 requests of one shared 1,536-token prefix plus a unique 64-token suffix,
  128 new tokens each, all submitted at once (the prefix is 391,680 of 409,600 prompt tokens);
- multi_turn: 32 conversations of 8 turns, each turn the whole history (earlier prompts and
  answers) plus 64-256 new user tokens, 128 new tokens; conversations start as a Poisson process
  and each turn is sent when the previous answer is in: TTFT by turn (the cache's goal: turn 8
  within 1.5x of turn 1, where recomputing grows with the history);
- no_sharing: bench/decode.py's 256 random requests (nothing to reuse: the cache's cost).
JSON: each workload's `off` and `on` hold `tokens_per_s` and `ttft_p50_ms` (multi_turn also
`ttft_p50_ms_by_turn`), with the prefix cache's hit rate and reused tokens.

    python3 bench/prefix.py --out bench/results/prefix-h200.json   # on the H200
    python bench/prefix.py --small --out /tmp/prefix.json           # CPU smoke run
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
from batchkv.executor import Engine, Request, SamplingParams
from batchkv.models import build_model, preset_config
from bench.lib.serving import release, serve_offline, sync, warm_up, workload


def engine_for(model, device, capacity: int, reuse: bool, small: bool) -> Engine:
    return Engine(model, max_seqs=16 if small else "auto", kv_positions=4096 if small else "auto", capacity=capacity,
                  max_step_tokens=64 if small else 1024, prefill_chunk=32 if small else 512, device=device,
                  prefix_cache=reuse)  # fmt: skip


def entry(engine: Engine, d: dict) -> dict:
    s = engine.metrics.summary()
    return {"tokens_per_s": d["output_tokens_per_s_wall"], "ttft_p50_ms": s["ttft_ms_p50"], "wall_s": d["wall_s"],
            "itl_p50_ms": s["itl_ms_p50"], "itl_p99_ms": s["itl_ms_p99"], "prefill_tokens": s["prefill_tokens"],
            "prefix_hit_rate": s["prefix_hit_rate"], "prefix_reused_tokens": s["prefix_reused_tokens"],
            "prefix_evictions": s["prefix_evictions"]}  # fmt: skip


def multi_turn(engine: Engine, vocab: int, device, small: bool) -> dict:
    """Conversations started as a Poisson process; each next turn sent when its answer is in."""
    rng = np.random.default_rng(11)
    convs, turns, new = (3, 2, 6) if small else (32, 8, 128)
    lo, hi = (8, 24) if small else (64, 256)
    starts = np.cumsum(rng.exponential(0.5, convs)).tolist()
    history: list[list[int]] = [[] for _ in range(convs)]
    turn = [0] * convs
    due: dict[int, float] = dict(enumerate(starts))  # conversation -> when its next turn is sent
    live: dict[int, tuple[int, float]] = {}  # request id -> (conversation, sent)
    answers: dict[int, list[int]] = {}
    ttft: list[list[float]] = [[] for _ in range(turns)]
    tokens = 0
    sync(device)
    start = time.perf_counter()
    for _ in range(10_000_000):
        now = time.perf_counter() - start
        for c in [c for c, t in due.items() if t <= now]:
            del due[c]
            history[c] = history[c] + rng.integers(0, vocab, int(rng.integers(lo, hi + 1))).tolist()
            rid = engine.submit(Request(history[c], SamplingParams(max_new_tokens=new)))
            live[rid], answers[rid] = (c, time.perf_counter()), []  # TTFT counts from the send
        if not live and not due:
            break
        for event in engine.step():
            c, sent = live[event.request_id]
            if event.token is not None:
                if not answers[event.request_id]:
                    ttft[turn[c]].append(time.perf_counter() - sent)
                answers[event.request_id].append(event.token)
                tokens += 1
            if event.finish_reason is not None:
                history[c] = history[c] + answers.pop(event.request_id)
                del live[event.request_id]
                turn[c] += 1
                if turn[c] < turns:
                    due[c] = time.perf_counter() - start
    sync(device)
    wall = time.perf_counter() - start
    by_turn = [1e3 * float(np.median(t)) for t in ttft]
    s = engine.metrics.summary()
    return {"tokens_per_s": tokens / wall, "ttft_p50_ms": 1e3 * float(np.median([x for t in ttft for x in t])),
            "ttft_p50_ms_by_turn": by_turn, "turn_last_over_first": by_turn[-1] / by_turn[0], "wall_s": wall,
            "prefix_hit_rate": s["prefix_hit_rate"], "prefix_reused_tokens": s["prefix_reused_tokens"],
            "prefix_evictions": s["prefix_evictions"]}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench/results/prefix-h200.json"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="tiny model and workloads: a smoke run")
    args = ap.parse_args()
    device, small = torch.device(args.device), args.small
    preset = "sensenova-u1-tiny" if small else "sensenova-u1-8b"
    vocab = preset_config(preset).vocab
    model = build_model(preset, device, seed=0)
    rng = np.random.default_rng(5)
    n, prefix_len, suffix_len, new = (6, 64, 8, 6) if small else (256, 1536, 64, 128)
    prefix = rng.integers(0, vocab, prefix_len).tolist()
    shared = [prefix + rng.integers(0, vocab, suffix_len).tolist() for _ in range(n)]
    plain_p, plain_o = workload(
        8 if small else 256, *(((8, 64), (4, 32)) if small else ((64, 2048), (64, 1024))), vocab
    )
    capacity = 512 if small else 32_768
    result: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "preset": preset,
                    "shared_prefix": {}, "multi_turn": {}, "no_sharing": {}}  # fmt: skip
    for reuse in (False, True):
        key = "on" if reuse else "off"
        engine = engine_for(model, device, capacity, reuse, small)
        warm_up(engine, device, plain_p, plain_o)  # graphs captured outside the timed runs, an empty prefix cache
        d = serve_offline(engine, device, shared, [new] * n)
        result["shared_prefix"][key] = entry(engine, d)
        engine.clear_prefix_cache()
        engine.metrics = engine.metrics.fresh()
        result["multi_turn"][key] = multi_turn(engine, vocab, device, small)
        engine.clear_prefix_cache()
        engine.metrics = engine.metrics.fresh()
        d = serve_offline(engine, device, plain_p, plain_o)
        result["no_sharing"][key] = entry(engine, d)
        result.setdefault("store", engine.sizing.describe() if engine.sizing else None)
        engine.close()
        release(device)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        for name in ("shared_prefix", "multi_turn", "no_sharing"):
            row = result[name][key]
            print(f"{name} {key}: {row['tokens_per_s']:.0f} tok/s, TTFT p50 {row['ttft_p50_ms']:.0f} ms", flush=True)
    for name in ("shared_prefix", "multi_turn", "no_sharing"):
        result[name]["on_over_off"] = result[name]["on"]["tokens_per_s"] / result[name]["off"]["tokens_per_s"]
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
