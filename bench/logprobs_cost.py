"""What log-probabilities cost a step: the same decode workload with and without `logprobs=k`.

SenseNova-U1-8B preset (random bf16 weights, vocabulary 151,936), 256 requests of 128-token
prompts and 64 new tokens each, all at once, on one engine (256 sequences, graphs and overlap on,
`warm_up` first). Runs alternate: no logprobs, logprobs=5, logprobs=20, twice over; each reports
the engine's step p50 (decode steps are most steps: 64 against 32 of prompts) and the wall time.

    python3 bench/logprobs_cost.py --out bench/results/logprobs-cost-h200.json   # on the H200
    python bench/logprobs_cost.py --small --out /tmp/lp.json                      # CPU smoke run
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
from batchkv.models import build_model


def run(engine: Engine, prompts: list[list[int]], new: int, k: int | None) -> dict:
    engine.clear_prefix_cache()
    engine.metrics = engine.metrics.fresh()
    for prompt in prompts:
        engine.submit(Request(prompt, SamplingParams(max_new_tokens=new, logprobs=k)))
    start = time.perf_counter()
    events = engine.run_until_done()
    wall = time.perf_counter() - start
    s = engine.metrics.summary()
    with_logprobs = sum(e.logprobs is not None for e in events if e.token is not None)
    return {"logprobs": k, "wall_s": wall, "step_ms_p50": s["step_ms_p50"], "steps": s["steps"],
            "tokens": s["generated_tokens"], "tokens_with_logprobs": with_logprobs}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("bench/results/logprobs-cost-h200.json"))
    ap.add_argument("--small", action="store_true", help="tiny preset on the CPU, 8 requests")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.small
    device = "cuda" if cuda else "cpu"
    n, prompt_len, new = (256, 128, 64) if not args.small else (8, 16, 8)
    model = build_model("sensenova-u1-8b" if not args.small else "sensenova-u1-tiny", device, seed=0)
    engine = Engine(model, max_seqs=n, capacity=prompt_len + new + 1, max_step_tokens=1024 if cuda else 64,
                    prefill_chunk=prompt_len, use_graphs=cuda, device=device)  # fmt: skip
    engine.warm_up()
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, engine.vocab_size, prompt_len).tolist() for _ in range(n)]
    run(engine, prompts, new, None)  # untimed: the first run's host caches and allocator
    runs = [run(engine, prompts, new, k) for _ in range(2) for k in (None, 5, 20)]
    base = np.mean([r["step_ms_p50"] for r in runs if r["logprobs"] is None])
    cost = {str(k): float(np.mean([r["step_ms_p50"] for r in runs if r["logprobs"] == k]) - base) for k in (5, 20)}
    result = {"device": torch.cuda.get_device_name() if cuda else "cpu", "requests": n, "prompt": prompt_len,
              "new_tokens": new, "vocab": engine.vocab_size, "runs": runs, "step_ms_p50_none": float(base),
              "added_step_ms_p50": cost}  # fmt: skip
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"step p50 without logprobs {base:.2f} ms; added: {cost}", flush=True)


if __name__ == "__main__":
    main()
