"""What soft-capping and attention sinks cost sdpa_varlen, and that they cost nothing when unused.

On bench/kernels.py's cases (bench/kernel_cases.py: SenseNova decode shapes, Hq 32, Hkv 8, D 128,
bf16), in one process, alternating variants in `--rounds` rounds (median per variant). A variant is
named `<what>[_<mode>][@<config>]`:
- what: `base` (the kernels of `--base`: a copy of an earlier tree's `batchkv` package renamed
  `batchkv_base`, its imports rewritten; `base_softcap`, `base_both`: that tree with the cap),
  `plain` (this tree, neither switch: the zero-cost claim is plain / base), `softcap` (a cap of 50,
  Gemma2's), `sinks` (one random logit per query head, gpt-oss's), `both`;
- mode (the kernels' SOFTCAP switch while it runs, `launch._softcap_mode`'s `SOFTCAP_APPROX`):
  none: the tree's default; `exact`: the exp2-and-division tanh (f7ec584 also had `f16`,
  `tanh.approx.f16x2`, and `split`, half the long path's exp2s on the FMA pipe: both measured slower);
- config: `SdpaConfig` long-path tiles replacing the default's: `s2` (2 stages), `n32` (32 keys),
  `n128` (128 keys, 2 stages), `m64` (64 rows, 4 warps, 2 stages), `w4` (4 warps).
Each variant is checked against the torch reference on rotation 0 (the reference with the same cap
and sinks) before it is timed (one over `TOLERANCE` is reported and left out of the timing); times
are CUDA-graph replays of back-to-back calls (bench/timing.py).

    python3 bench/kernels.py --softcap-sinks-ab --base .base --out bench/results/softcap-sinks-ab-h200.json
    python3 bench/kernels.py --softcap-sinks-ab --variants softcap,both,softcap@m64 --cases prefill-4x512
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
from dataclasses import replace
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from batchkv.ops import sdpa_varlen_reference
from batchkv.ops.sdpa import launch as launcher
from batchkv.ops.sdpa.common import SOFTCAP_APPROX, SOFTCAP_EXACT
from batchkv.ops.sdpa.config import DEFAULT_CONFIG
from batchkv.ops.sdpa.launch import sdpa_varlen
from bench.lib.kernel_cases import CASES, SMALL_CASES, TOLERANCE, build_cases
from bench.lib.timing import time_calls

SOFTCAP = 50.0
MODES = {"": None, "exact": SOFTCAP_EXACT}
CONFIGS = {"": {}, "s2": dict(num_stages_long=2), "n32": dict(block_n_long=32), "w4": dict(num_warps_long=4),
           "n128": dict(block_n_long=128, num_stages_long=2),
           "m64": dict(block_m_long=64, num_warps_long=4, num_stages_long=2)}  # fmt: skip
DEFAULT_VARIANTS = "base,plain,softcap,sinks,both,softcap_exact,both_exact"


def variant(name: str, base, sinks: torch.Tensor) -> tuple:
    """name -> (sdpa_varlen function, its keyword arguments, the SOFTCAP mode while it runs or None)."""
    what, _, cfg = name.partition("@")
    what, _, mode = what.partition("_") if not what.startswith("base_") else ("base_" + what[5:], "", "")
    extras = {"plain": {}, "softcap": {"softcap": SOFTCAP}, "sinks": {"sinks": sinks},
              "both": {"softcap": SOFTCAP, "sinks": sinks}}  # fmt: skip
    fn = sdpa_varlen
    if what == "base" or what.startswith("base_"):
        if base is None:
            raise SystemExit(f"{name}: needs --base")
        fn, what = base, what[5:] or "plain"
    if what not in extras or mode not in MODES or cfg not in CONFIGS:
        raise SystemExit(f"{name}: not a variant (what {list(extras)}, modes {list(MODES)}, configs {list(CONFIGS)})")
    kw = dict(extras[what])
    if CONFIGS[cfg]:
        kw["config"] = replace(DEFAULT_CONFIG, **CONFIGS[cfg])
    return fn, kw, MODES[mode]


def set_mode(mode: int | None) -> None:
    """The SOFTCAP mode `_softcap_mode` returns for a cap (None: the tree's own), read when calls are captured."""
    launcher.SOFTCAP_TANH_APPROX = mode != SOFTCAP_EXACT
    launcher._softcap_mode.__globals__["SOFTCAP_APPROX"] = SOFTCAP_APPROX if mode in (None, SOFTCAP_EXACT) else mode


def calls_of(case, k, v, fn, kw) -> list:
    out = torch.empty_like(case.q)
    return [lambda j=j: fn(case.q, k, v, case.tables[j % case.rot], out=out, **kw) for j in range(case.calls)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results/softcap-sinks-ab-h200.json"))
    parser.add_argument("--base", type=Path, default=None, help="a folder holding batchkv_base (the tree before)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--variants", default=DEFAULT_VARIANTS, help="comma-separated (see above); plain always")
    parser.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    args = parser.parse_args()
    base = None
    if args.base is not None:
        sys.path.insert(0, str(args.base.resolve()))
        try:  # the launcher's module: ops/sdpa/launch.py, or ops/sdpa_varlen_triton.py in trees before the move
            base = importlib.import_module("batchkv_base.ops.sdpa.launch").sdpa_varlen
        except ModuleNotFoundError:
            base = importlib.import_module("batchkv_base.ops.sdpa_varlen_triton").sdpa_varlen
    cuda = torch.cuda.is_available()
    names = args.cases.split(",") if args.cases else list(SMALL_CASES if args.small else CASES)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size if cuda else 1 << 16
    geo, cases = build_cases(names, args.small, l2)
    k = torch.randn(geo.rows, geo.columns, geo.hkv, geo.d, device=geo.device, dtype=geo.dtype)
    v_store = torch.randn_like(k)
    sinks = torch.randn(geo.hq, generator=torch.Generator().manual_seed(1)).to(geo.device)
    names_v = ["plain"] + [v for v in args.variants.split(",") if v and v != "plain"]
    names_v = [v for v in names_v if base is not None or not v.startswith("base")]
    table = {v: variant(v, base, sinks) for v in names_v}
    report: dict = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__,
                    "softcap": SOFTCAP, "rounds": args.rounds, "cases": {}, "errors": {}}  # fmt: skip
    start = time.perf_counter()
    failed: set = set()
    for name, case in cases.items():
        for v, (fn, kw, mode) in table.items():
            set_mode(mode)
            extras = {a: b for a, b in kw.items() if a != "config"}
            ref = sdpa_varlen_reference(case.q, k, v_store, case.tables[0], **extras)
            err = float((calls_of(case, k, v_store, fn, kw)[0]().float() - ref.float()).abs().max())
            report["errors"].setdefault(name, {})[v] = err
            if not err < TOLERANCE:
                print(f"{name} {v}: max error {err} against the reference; left out of the timing")
                failed.add(v)
    table = {v: row for v, row in table.items() if v not in failed}
    report["failed"] = sorted(failed)
    times: dict = {n: {v: [] for v in table} for n in cases}
    for r in range(args.rounds):
        order = list(table) if r % 2 == 0 else list(reversed(table))
        for name, case in cases.items():
            for v in order:
                fn, kw, mode = table[v]
                set_mode(mode)  # read when the calls are captured
                us, _ = time_calls(calls_of(case, k, v_store, fn, kw))
                times[name][v].append(us)
    for name in cases:
        med = {v: round(statistics.median(t), 2) for v, t in times[name].items()}
        row = {"us": med, "runs_us": {v: [round(x, 2) for x in t] for v, t in times[name].items()}}
        row["ratio"] = {v: round(med[v] / med["plain"], 4) for v in med if v != "plain"}
        report["cases"][name] = row
        print(f"{name:16s} " + " ".join(f"{v} {u:8.2f}" for v, u in med.items()) + f"  ratios {row['ratio']}")
    for v in table:
        if v != "plain":
            ratios = [report["cases"][n]["ratio"][v] for n in cases]
            report.setdefault("geomean_ratio_vs_plain", {})[v] = round(statistics.geometric_mean(ratios), 4)
            report.setdefault("max_ratio_vs_plain", {})[v] = max(ratios)
    report["wall_s"] = round(time.perf_counter() - start, 1)
    print(json.dumps({k: report[k] for k in ("geomean_ratio_vs_plain", "max_ratio_vs_plain")}))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
