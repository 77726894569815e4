"""`bench/kernels.py --sweep`: time a grid of SdpaConfig choices on a few cases (sets the defaults).

Each config runs on SWEEP_CASES under its own try and is checked against the reference; the result
file is written after every config, with each config's geometric-mean speedup over the default.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from batchkv.ops.sdpa.launch import SdpaConfig, sdpa_varlen

from .kernel_cases import TOLERANCE, Case
from .timing import time_calls

SWEEP_CASES = ("b1-l1024", "b1-l9100", "b8-mixed", "b64-mixed", "b32-verify4", "prefill-4x512")
SWEEP = [  # SdpaConfig overrides; the first is the default (heads 1 below 16 tokens, else 4)
    {},
    {"heads": 1},  # one KV head per program at every width (the previous layout)
    {"heads": 4},  # four at every width, b1 and b8 too
    {"heads": 8, "occupancy": 1},  # 2 KiB key rows, 8 warps, one 160 KiB program per SM
    {"heads": 2, "occupancy": 4},  # 2 warps per program
    {"min_blocks": 2},  # fewer partials for short totals (b1)
    {"occupancy": 1},
    {"occupancy": 3},  # registers capped at 168
    {"num_stages": 4},
    {"skip_masks": False},
    {"heads": 4, "merge_tile": 16384},  # 2x the partials per merge round trip
    {"block_m_long": 64, "num_warps_long": 4, "num_stages_long": 2},  # the previous prefill tiles
]
FEW_CASES = ("b8-mixed", "b64-l512", "b64-mixed")  # few long programs, short histories, and the full batch
FEW = [  # `--sweep-grid few`: the split path's choices where FlashInfer leads (8 sequences, 512-key histories)
    {},
    {"programs": 64},  # 64 per head group: one 512-key sequence per program at 64 x 512, no merge
    {"programs": 64, "max_regs": 128},  # ... and four programs per SM resident
    {"occupancy": 3},
    {"min_blocks": 2},
    {"min_blocks": 4},
    {"block_n": 128},
    {"num_stages": 4},
    {"prefetch": 2},
    {"merge_tile": 16384},
]
GRIDS = {"defaults": (SWEEP, SWEEP_CASES), "few": (FEW, FEW_CASES)}


def batchkv_calls(case: Case, k, v, config: SdpaConfig | None) -> list:
    """sdpa_varlen on rotation j of `case` for each of its calls, into one output buffer."""
    out = torch.empty_like(case.q)
    return [
        lambda j=j: sdpa_varlen(case.q, k, v, case.tables[j % case.rot], out=out, config=config)
        for j in range(case.calls)
    ]


def _write(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")


def sweep(cases: dict, k, v, ceiling: float, path: Path, grid: str = "defaults") -> None:
    """Every config of GRIDS[grid] on its cases present in `cases`; µs, % of `ceiling` (copy GB/s), TFLOP/s."""
    configs, grid_cases = GRIDS[grid]
    names = [n for n in grid_cases if n in cases] or list(cases)
    results: list[dict] = []
    for overrides in configs:
        row: dict = {"config": overrides, "us": {}, "pct_of_copy": {}, "tflops": {}, "errors": {}}
        for n in names:
            case = cases[n]
            try:
                calls = batchkv_calls(case, k, v, SdpaConfig(**overrides))
                err = case.error(calls[0](), k, v)
                if not err < TOLERANCE:
                    raise RuntimeError(f"max error {err} against the reference")
                us, _ = time_calls(calls)
                row["us"][n] = round(us, 2)
                row["pct_of_copy"][n] = round(100 * case.bytes / us / 1e3 / ceiling, 1)
                row["tflops"][n] = round(case.flops / us / 1e6, 1)
            except Exception as exc:
                row["errors"][n] = f"{type(exc).__name__}: {exc}"[:300]
        results.append(row)
        base = results[0]["us"]
        ratio = [base[n] / row["us"][n] for n in names if n in row["us"] and n in base]
        row["speedup_vs_default"] = round(math.prod(ratio) ** (1 / len(ratio)), 3) if ratio else None
        print(f"{json.dumps(overrides):58s} " + " ".join(f"{row['us'].get(n, float('nan')):9.2f}" for n in names)
              + f"  x{row['speedup_vs_default']}" + (f"  {row['errors']}" if row["errors"] else ""))  # fmt: skip
        _write(path, {"copy_gbps": ceiling, "cases": names, "results": results})
    ranked = sorted((r for r in results if r.get("speedup_vs_default")), key=lambda r: -r["speedup_vs_default"])
    _write(path, {"copy_gbps": ceiling, "cases": names, "results": results, "best": ranked[0] if ranked else None})
    print("best:", json.dumps(ranked[0]) if ranked else None)
