"""What constrained decoding costs: a decode workload where 10% of requests carry a JSON schema.

SenseNova-U1-8B preset (random bf16 weights, vocabulary 151,936), 256 requests of 128-token prompts
and 64 new tokens each, all at once, on one engine (256 sequences, graphs and overlap on, `warm_up`
first). The grammar engine is xgrammar over a synthetic byte-level vocabulary of the model's size
(the 95 printable ASCII characters, then pieces of 2 to 6 of them, seeded: no tokenizer download),
so the bitmask fill is as wide as a real Qwen vocabulary's. Runs alternate: no constraint, then 10%
of the requests (every tenth) constrained by a JSON schema, twice over. Each run reports the wall
time, the engine's step p50, the unconstrained requests' tokens/s, and the inter-token p50 of the
constrained and of the unconstrained samples (host times of the steps that emitted each token).

The issue's targets: the unconstrained requests' throughput within 5% of the run without
constraints, the constrained ones' inter-token p50 within 1.5x of the unconstrained ones'.

    python3 bench/structured.py --out bench/results/structured-h200.json   # on the H200
    python bench/structured.py --small --out /tmp/structured.json          # CPU smoke run
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
from batchkv.executor.constraints import Constraint
from batchkv.models import build_model

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
        "score": {"type": "integer", "minimum": 0, "maximum": 100},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "tags", "score", "ok"],
    "additionalProperties": False,
}
SHARE = 10  # every SHARE-th request is constrained


def synthetic_vocab(size: int, seed: int = 0) -> list[str]:
    """`size` distinct tokens: the printable ASCII characters, then seeded pieces of 2-6 of them."""
    chars = [chr(c) for c in range(32, 127)]
    rng = np.random.default_rng(seed)
    out, seen = list(chars), set(chars)
    while len(out) < size:
        piece = "".join(rng.choice(chars, int(rng.integers(2, 7))))
        if piece not in seen:
            seen.add(piece)
            out.append(piece)
    return out[:size]


def run(engine: Engine, prompts: list[list[int]], new: int, constrained: bool) -> dict:
    engine.clear_prefix_cache()
    engine.metrics = engine.metrics.fresh()
    schema = Constraint.json_schema(SCHEMA)
    kinds: dict[int, bool] = {}  # request -> constrained in this run
    other: set[int] = set()  # the requests that never carry a schema: both runs count their tokens alone
    for i, prompt in enumerate(prompts):
        tight = constrained and i % SHARE == 0
        params = SamplingParams(max_new_tokens=new, temperature=0.8, seed=i, constraint=schema if tight else None)
        rid = engine.submit(Request(prompt, params))
        kinds[rid] = tight
        if i % SHARE:
            other.add(rid)
    last: dict[int, float] = {}
    gaps: dict[bool, list[float]] = {True: [], False: []}
    tokens: dict[bool, int] = {True: 0, False: 0}
    others = 0  # tokens of `other`
    start = time.perf_counter()
    for event in engine.stream():
        if event.token is None:
            continue
        now = time.perf_counter()
        tight = kinds[event.request_id]
        tokens[tight] += 1
        others += event.request_id in other
        if event.request_id in last:
            gaps[tight].append(now - last[event.request_id])
        last[event.request_id] = now
    wall = time.perf_counter() - start
    s = engine.metrics.summary()

    def p50(values: list[float]) -> float | None:
        return float(np.median(values)) * 1e3 if values else None

    return {"constrained": constrained, "wall_s": wall, "step_ms_p50": s["step_ms_p50"], "steps": s["steps"],
            "tokens": tokens[False] + tokens[True], "unconstrained_tok_s": others / wall,
            "itl_ms_p50_unconstrained": p50(gaps[False]), "itl_ms_p50_constrained": p50(gaps[True]),
            "finished": dict(engine.metrics.finished)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("bench/results/structured-h200.json"))
    ap.add_argument("--small", action="store_true", help="tiny preset on the CPU, 10 requests")
    args = ap.parse_args()
    cuda = torch.cuda.is_available() and not args.small
    device = "cuda" if cuda else "cpu"
    n, prompt_len, new = (256, 128, 64) if not args.small else (10, 8, 4)
    model = build_model("sensenova-u1-8b" if not args.small else "sensenova-u1-tiny", device, seed=0)
    engine = Engine(model, max_seqs=n, capacity=prompt_len + new + 1, max_step_tokens=1024 if cuda else 64,
                    prefill_chunk=prompt_len, use_graphs=cuda, device=device)  # fmt: skip
    import xgrammar

    vocab = engine.vocab_size
    engine.use_tokenizer(xgrammar.TokenizerInfo(synthetic_vocab(vocab), vocab_size=vocab))
    start = time.perf_counter()
    engine.grammars.compile(Constraint.json_schema(SCHEMA), timeout=600.0)  # cached for every run
    compile_s = time.perf_counter() - start
    engine.warm_up()
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, vocab, prompt_len).tolist() for _ in range(n)]
    run(engine, prompts, new, True)  # untimed: host caches, the allocator, the grammar's compile
    runs = [run(engine, prompts, new, c) for _ in range(2) for c in (False, True)]
    plain = [r for r in runs if not r["constrained"]]
    mixed = [r for r in runs if r["constrained"]]
    base_tok_s = float(np.mean([r["unconstrained_tok_s"] for r in plain]))
    mixed_tok_s = float(np.mean([r["unconstrained_tok_s"] for r in mixed]))
    itl_free = float(np.mean([r["itl_ms_p50_unconstrained"] for r in mixed]))
    itl_tight = float(np.mean([r["itl_ms_p50_constrained"] for r in mixed]))
    result = {"device": torch.cuda.get_device_name() if cuda else "cpu", "requests": n, "constrained_share": 1 / SHARE,
              "prompt": prompt_len, "new_tokens": new, "vocab": vocab, "compile_s": compile_s, "runs": runs,
              "unconstrained_tok_s_ratio": mixed_tok_s / base_tok_s, "constrained_itl_ratio": itl_tight / itl_free,
              "step_ms_p50_without": float(np.mean([r["step_ms_p50"] for r in plain])),
              "step_ms_p50_with": float(np.mean([r["step_ms_p50"] for r in mixed]))}  # fmt: skip
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    ratio, itl = result["unconstrained_tok_s_ratio"], result["constrained_itl_ratio"]
    print(f"unconstrained tokens/s with 10% constrained: {ratio:.3f}x of none; constrained inter-token p50 "
          f"{itl:.2f}x the unconstrained", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
