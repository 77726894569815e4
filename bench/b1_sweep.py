"""sdpa_varlen for one decoding sequence (T = 1): a grid of SdpaConfig choices beside SDPA exact prefix.

One sequence is latency-bound, not bandwidth-bound: the launch, the prologue, a short pipelined loop
and the merge of the partials set its time. This times every config of GRID at 16, 256, 1,024, 4,096,
9,100 and 16,384 keys (Hq 32, Hkv 8, D 128, bf16, a 2-column store of 16,384 rows whose scratch
column is NaN, so the shapes are the single-sequence facade's), each the median of 100 CUDA-graph
replays of 16 back-to-back calls, one per copy of the store, so the data comes from HBM, not the L2.
SDPA over the exact prefix with enable_gqa (flash, efficient and cuDNN backends, the fastest kept)
is timed the same way, and the read ceiling (bench/ceilings.py) is measured in the same run. Each
config is checked against the torch reference first. Per config: µs, µs / SDPA's, % of the read
ceiling, and whether it meets the targets (<= SDPA at 1,024 to 16,384 keys, >= 65% of the read
ceiling at 9,100 and 16,384). Then the default and the best few (by summed µs over the target
lengths) are timed on the b32-mixed and b64-mixed kernel cases (bench/kernel_cases.py), which must
not regress; a winner that does can still serve one sequence alone, as
`SdpaConfig(narrow=SdpaConfig(**winner), narrow_width=w)` (steps of at most w tokens). --narrow
times the default and the split_merge configs on few-token steps (NARROW: 1, 2, 4, 8 and 16
decoding sequences, one 16-token verify block), which sets that width. --only keeps the configs
whose JSON contains a string. Writes every row as it goes; stops starting configs after --budget-s.

    python3 bench/b1_sweep.py --out bench/results/b1-sweep-h200.json     # on the GPU, ~2-3 minutes
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ceilings import read_ceiling
from kernel_cases import TOLERANCE, build_cases
from kernel_sweep import batchkv_calls
from timing import time_calls

from batchkv.ops import sdpa_varlen_reference
from batchkv.ops.sdpa_varlen_triton import SdpaConfig, sdpa_varlen

HQ, HKV, D, ROWS, COPIES, DTYPE = 32, 8, 128, 16384, 16, torch.bfloat16
LENGTHS = (16, 256, 1024, 4096, 9100, 16384)  # 16 and 256: the fixed cost (launch, prologue, merge)
TARGETS = (1024, 4096, 9100, 16384)  # <= SDPA exact here; >= READ_TARGET of the read ceiling at the last two
READ_TARGET = 0.65
MIXED = ("b32-mixed", "b64-mixed")  # must not regress (within 3% of the default)
NARROW = ("b1-l1024", "b1-l9100", "b2-l4096", "b4-mixed", "b8-mixed", "b16-mixed", "b1-verify16")
GRID = [  # most informative first, in case the budget ends the run early
    {},
    {"occupancy": 2, "block_n": 32, "min_blocks": 2},  # the best by sum of the 2026-11-30 sweep
    # two launches: equal runs of the keys per program, then a merge (no scan, no atomics)
    {"split_merge": True},
    {"split_merge": True, "pdl": False},  # the merge launched after the partials finish
    {"split_merge": True, "occupancy": 3},
    {"split_merge": True, "num_stages": 4},
    {"split_merge": True, "num_stages": 2},
    {"split_merge": True, "occupancy": 4},
    {"split_merge": True, "occupancy": 1},
    {"split_merge": True, "block_n": 128, "num_warps": 8},
    {"split_merge": True, "block_n": 32, "occupancy": 4},
    # keys cut across warps: one softmax state per warp, 2 CTA barriers per key block instead of 9
    {"warp_split": 4},
    {"warp_split": 4, "occupancy": 1},
    {"warp_split": 4, "num_stages": 4},
    {"warp_split": 4, "min_blocks": 2},
    {"warp_split": 2},  # 2 warps, 32 keys each
    {"warp_split": 8, "block_n": 128, "num_stages": 2, "occupancy": 1},  # one 8-warp program per SM
    # L2 prefetch of the next blocks (the first ones before q is read)
    {"prefetch": 2},
    {"prefetch": 4},
    {"prefetch": 8},
    {"prefetch": 4, "occupancy": 1},
    {"prefetch": 4, "warp_split": 4},
    {"prefetch": 8, "warp_split": 4},
    {"prefetch": 4, "warp_split": 4, "occupancy": 1},
    {"prefetch": 8, "warp_split": 4, "occupancy": 1},
    {"prefetch": 4, "warp_split": 4, "min_blocks": 2},
    {"prefetch": 4, "warp_split": 4, "num_stages": 2},  # the L2 holds the stream: fewer smem stages
    {"prefetch": 4, "warp_split": 8, "block_n": 128, "num_stages": 3, "occupancy": 1},
    # the last-arriver merge (33 partials per item at 9,100 keys: 3 round trips of 16 by default)
    {"merge_tile": 16384},  # 32 partials per round trip
    {"merge_stages": 2},  # the next round's partials load while one combines
    {"merge_stages": 2, "merge_tile": 16384},
    {"merge_stages": 2, "prefetch": 4, "warp_split": 4},
    {"merge_stages": 2, "prefetch": 8, "warp_split": 4, "occupancy": 1},
    {"merge_tile": 16384, "prefetch": 8, "warp_split": 4, "occupancy": 1},
    {"warp_split": 2, "num_stages": 2, "occupancy": 4},  # four 2-warp programs per SM (3 stages would not fit 4)
]


def graph_us(calls, replays: int = 100) -> float:
    """Median µs per call of `calls` captured in one graph (bench/timing.py)."""
    return time_calls(calls, replays=replays)[0]


def kv_bytes(n: int) -> int:
    return n * HKV * D * 2 * DTYPE.itemsize  # K and V


def sdpa_exact(q, stores, report: dict) -> None:
    """SDPA over each length's exact prefix, every backend that runs it; the fastest per length."""
    qq = q.transpose(0, 1)[None]  # [1, Hq, 1, D]
    for n in LENGTHS:
        prefixes = [(k[:n, 0].transpose(0, 1)[None].contiguous(), v[:n, 0].transpose(0, 1)[None].contiguous())
                    for k, v in stores]  # fmt: skip
        tried = {}
        for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):
            try:
                with torch.nn.attention.sdpa_kernel(backend):
                    calls = [lambda k=k, v=v: F.scaled_dot_product_attention(qq, k, v, enable_gqa=True)
                             for k, v in prefixes]  # fmt: skip
                    tried[backend.name] = round(graph_us(calls), 2)
            except Exception as exc:  # a backend that refuses the shape is skipped, and says so
                tried[backend.name] = f"{type(exc).__name__}: {exc}"[:120]
        timed = {b: us for b, us in tried.items() if isinstance(us, float)}
        best = min(timed, key=timed.get) if timed else None
        report["sdpa_exact"][n] = {"us": timed[best], "backend": best, "tried": tried} if best else {"tried": tried}
        print(f"{n:6d} keys: SDPA exact {report['sdpa_exact'][n]}", flush=True)


def score(row: dict, report: dict) -> None:
    """µs / SDPA's, % of the read ceiling and whether the targets are met, added to `row`."""
    us, sdpa, read = row["us"], report["sdpa_exact"], report["read_gbps"]
    row["vs_sdpa"] = {n: round(us[n] / sdpa[n]["us"], 3) for n in us if sdpa.get(n, {}).get("us")}
    row["pct_of_read"] = {n: round(100 * kv_bytes(n) / us[n] / 1e3 / read, 1) for n in us}
    if all(n in us for n in TARGETS):
        row["meets_targets"] = all(row["vs_sdpa"].get(n, 9) <= 1 for n in TARGETS) and all(
            row["pct_of_read"][n] >= 100 * READ_TARGET for n in TARGETS[-2:]
        )


def time_cases(configs: list[dict], names: tuple[str, ...], key: str, report: dict, path: Path) -> None:
    """Each config on the named kernel cases (checked against the reference first), appended to
    report[key] with µs / the first config's as `vs_default` (the first is `{}`: SdpaConfig(), the
    main path, which is no longer DEFAULT_CONFIG for narrow steps)."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    geo, cases = build_cases(list(names), False, l2)
    k = torch.randn(geo.rows, geo.columns, geo.hkv, geo.d, device=geo.device, dtype=geo.dtype)
    v = torch.randn_like(k)
    report[key] = []
    for config in configs:
        entry = {"config": config, "us": {}}
        for name, case in cases.items():
            try:
                calls = batchkv_calls(case, k, v, SdpaConfig(**config))
                err = case.error(calls[0](), k, v)
                if not err < TOLERANCE:
                    raise RuntimeError(f"max error {err} against the reference")
                entry["us"][name] = round(time_calls(calls)[0], 2)
            except Exception as exc:
                entry.setdefault("errors", {})[name] = f"{type(exc).__name__}: {exc}"[:200]
        base = report[key][0]["us"] if report[key] else entry["us"]
        entry["vs_default"] = {n: round(entry["us"][n] / base[n], 3) for n in entry["us"] if n in base}
        report[key].append(entry)
        print(key, json.dumps(entry), flush=True)
        path.write_text(json.dumps(report, indent=1) + "\n")


def mixed(rows: list[dict], top: int, report: dict, path: Path) -> None:
    """b32-mixed and b64-mixed for the default and the `top` configs by summed µs over TARGETS."""
    ok = [r for r in rows[1:] if all(n in r["us"] for n in TARGETS)]
    picked = [rows[0], *sorted(ok, key=lambda r: sum(r["us"][n] for n in TARGETS))[:top]]
    time_cases([r["config"] for r in picked], MIXED, "mixed", report, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("bench/results/b1-sweep-h200.json"))
    ap.add_argument("--budget-s", type=float, default=200.0, help="start no new config after this many seconds")
    ap.add_argument("--mixed-top", type=int, default=3, help="configs (besides the default) timed on b32/b64-mixed")
    ap.add_argument("--only", default="", help="keep the GRID configs (and the default) whose JSON contains this")
    ap.add_argument("--narrow", action="store_true", help="also time the split_merge configs on the NARROW cases")
    args = ap.parse_args()
    grid = [c for c in GRID if not c or args.only in json.dumps(c)]
    started = time.perf_counter()
    torch.manual_seed(0)
    stores = []
    for _ in range(COPIES):  # column 0 holds the sequence; column 1, the scratch, is NaN and never read
        k, v = (torch.randn(ROWS, 2, HKV, D, device="cuda", dtype=DTYPE) for _ in range(2))
        k[:, 1] = v[:, 1] = float("nan")
        stores.append((k, v))
    q = torch.randn(1, HQ, D, device="cuda", dtype=DTYPE)
    out = torch.empty_like(q)
    report: dict = {"device": torch.cuda.get_device_name(), "lengths": LENGTHS, "grid": grid, "sdpa_exact": {},
                    "rows": [], "mixed": []}  # fmt: skip
    report["read_gbps"], report["read_variants_gbps"] = read_ceiling(q.device)
    print(f"read ceiling {report['read_gbps']:.0f} GB/s", flush=True)
    sdpa_exact(q, stores, report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for overrides in grid:
        if time.perf_counter() - started > args.budget_s:
            report["skipped_by_budget"] = grid[grid.index(overrides) :]
            break
        row = {"config": overrides, "us": {}}
        try:
            cfg = SdpaConfig(**overrides)
            for n in LENGTHS:
                info = torch.tensor([[0, 1, 0, n]], dtype=torch.int32, device="cuda")
                ref = sdpa_varlen_reference(q, *stores[0], info).float()
                err = (sdpa_varlen(q, *stores[0], info, config=cfg).float() - ref).abs().max()
                if not err < TOLERANCE:
                    raise RuntimeError(f"max error {err.item()} at {n} keys")
                calls = [lambda k=k, v=v, info=info, cfg=cfg: sdpa_varlen(q, k, v, info, out=out, config=cfg)
                         for k, v in stores]  # fmt: skip
                row["us"][n] = round(graph_us(calls), 2)
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"[:200]
        score(row, report)
        report["rows"].append(row)
        print(json.dumps(row), flush=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    ok = [r for r in report["rows"] if len(r["us"]) == len(LENGTHS)]
    report["best_by_sum"] = min(ok, key=lambda r: sum(r["us"][n] for n in TARGETS)) if ok else None
    report["meeting_targets"] = [r["config"] for r in ok if r.get("meets_targets")]
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print("best:", report["best_by_sum"], "\nmeeting the targets:", report["meeting_targets"], flush=True)
    if ok and args.mixed_top >= 0:
        mixed(report["rows"], args.mixed_top, report, args.out)
    if args.narrow:
        time_cases([c for c in grid if not c or c.get("split_merge")], NARROW, "narrow", report, args.out)
    report["wall_s"] = round(time.perf_counter() - started, 1)
    args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
