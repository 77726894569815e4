"""What soft-capping and attention sinks cost sdpa_varlen, and that they cost nothing when unused.

On bench/kernels.py's cases (bench/kernel_cases.py: SenseNova decode shapes, Hq 32, Hkv 8, D 128,
bf16), in one process, alternating variants in `--rounds` rounds (median per variant):
- `base`: the kernels before soft-capping and sinks existed, imported from `--base` (a copy of that
  tree's `batchkv` package renamed `batchkv_base`, its imports rewritten), when given;
- `plain`: this tree, neither switch (the zero-cost claim: plain / base);
- `softcap` (a cap of 50, Gemma2's), `sinks` (one random logit per query head, gpt-oss's), `both`.
Each variant is checked against the torch reference on rotation 0 (the reference with the same cap
and sinks) before it is timed; times are CUDA-graph replays of back-to-back calls (bench/timing.py).

    python3 bench/kernels.py --softcap-sinks-ab --base .base --out bench/results/softcap-sinks-ab-h200.json
    python bench/kernels.py --softcap-sinks-ab --small --out /tmp/ab.json     # CPU smoke run (interpreter)
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_cases import CASES, SMALL_CASES, TOLERANCE, build_cases
from timing import time_calls

from batchkv.ops import sdpa_varlen_reference
from batchkv.ops.sdpa.launch import sdpa_varlen

SOFTCAP = 50.0


def variants(base, sinks: torch.Tensor) -> dict:
    """name -> (sdpa_varlen function, its extra keyword arguments)."""
    extras = {"plain": {}, "softcap": {"softcap": SOFTCAP}, "sinks": {"sinks": sinks},
              "both": {"softcap": SOFTCAP, "sinks": sinks}}  # fmt: skip
    out = {name: (sdpa_varlen, kw) for name, kw in extras.items()}
    return ({"base": (base, {})} if base is not None else {}) | out


def calls_of(case, k, v, fn, kw) -> list:
    out = torch.empty_like(case.q)
    return [lambda j=j: fn(case.q, k, v, case.tables[j % case.rot], out=out, **kw) for j in range(case.calls)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results/softcap-sinks-ab-h200.json"))
    parser.add_argument("--base", type=Path, default=None, help="a folder holding batchkv_base (the tree before)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--small", action="store_true")
    args = parser.parse_args()
    base = None
    if args.base is not None:
        sys.path.insert(0, str(args.base.resolve()))
        base = importlib.import_module("batchkv_base.ops.sdpa.launch").sdpa_varlen
    cuda = torch.cuda.is_available()
    names = list(SMALL_CASES if args.small else CASES)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size if cuda else 1 << 16
    geo, cases = build_cases(names, args.small, l2)
    k = torch.randn(geo.rows, geo.columns, geo.hkv, geo.d, device=geo.device, dtype=geo.dtype)
    v = torch.randn_like(k)
    sinks = torch.randn(geo.hq, generator=torch.Generator().manual_seed(1)).to(geo.device)
    table = variants(base, sinks)
    report: dict = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__,
                    "softcap": SOFTCAP, "rounds": args.rounds, "cases": {}, "errors": {}}  # fmt: skip
    start = time.perf_counter()
    for name, case in cases.items():
        for variant, (fn, kw) in table.items():
            ref = sdpa_varlen_reference(case.q, k, v, case.tables[0], **kw).float()
            err = float((calls_of(case, k, v, fn, kw)[0]().float() - ref).abs().max())
            report["errors"].setdefault(name, {})[variant] = err
            if not err < TOLERANCE:
                raise SystemExit(f"{name} {variant}: max error {err} against the reference")
    times: dict = {n: {v: [] for v in table} for n in cases}
    for r in range(args.rounds):
        order = list(table) if r % 2 == 0 else list(reversed(table))
        for name, case in cases.items():
            for variant in order:
                fn, kw = table[variant]
                us, _ = time_calls(calls_of(case, k, v, fn, kw))
                times[name][variant].append(us)
    for name in cases:
        med = {v: round(statistics.median(t), 2) for v, t in times[name].items()}
        row = {"us": med, "runs_us": {v: [round(x, 2) for x in t] for v, t in times[name].items()}}
        row["ratio"] = {v: round(med[v] / med["plain"], 4) for v in med if v != "plain"}
        report["cases"][name] = row
        print(f"{name:16s} " + " ".join(f"{v} {u:8.2f}" for v, u in med.items()) + f"  ratios {row['ratio']}")
    for variant in table:
        if variant != "plain":
            ratios = [report["cases"][n]["ratio"][variant] for n in cases]
            report.setdefault("geomean_ratio_vs_plain", {})[variant] = round(statistics.geometric_mean(ratios), 4)
            report.setdefault("max_ratio_vs_plain", {})[variant] = max(ratios)
    report["wall_s"] = round(time.perf_counter() - start, 1)
    print(json.dumps({k: report[k] for k in ("geomean_ratio_vs_plain", "max_ratio_vs_plain")}))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
