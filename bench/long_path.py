"""The long path (prompt chunks) under a grid of SdpaConfig long-path choices, on bf16 and e4m3 stores.

Cases: bench/kernels.py's prompt cases (`prefill-4x512`: four 512-token chunks after 1,024-token
histories; `prefill-1x2048`: one 2,048-token prompt), the same geometry, seed and lengths, plus
`prefill-1x512-h8k` (one 512-token chunk after an 8,192-token history: a long prompt's later chunk).
Each config runs every case on the bf16 store and, where `--e4m3` names it, on the e4m3 codes of the
same values (scales in the cache's layout; QK^T an e4m3 dot, `SdpaConfig.e4m3_qk_long`, as by
default); each is checked against the torch reference on the same stored values (a failure is
recorded, the grid goes on) and timed as bench/kernels.py times (calls rotating over column sets
in one CUDA graph, median replay). TFLOP/s count the causal (query, key) pairs once, as
kernels-h200.json does. JSON after every config.

    python3 bench/long_path.py --out bench/results/long-path-h200.json
    python bench/long_path.py --small --out /tmp/long.json      # CPU smoke (interpreter), tiny shapes
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import torch
from kernel_cases import FULL, SMALL, TOLERANCE, Case, e4m3_store
from timing import time_calls

from batchkv.ops import sdpa_varlen_reference
from batchkv.ops.reference import dequantize_fp8, quantize_queries
from batchkv.ops.sdpa_varlen_triton import DEFAULT_CONFIG, SdpaConfig, resolve_config, sdpa_varlen

CASES = {  # name: (batch, q_len, kv_end of each sequence)
    "prefill-4x512": (4, 512, [1536] * 4),
    "prefill-1x2048": (1, 2048, [2048]),
    "prefill-1x512-h8k": (1, 512, [8704]),
}
SMALL_CASES = {"prefill-2x64": (2, 64, [100, 64]), "prefill-1x96": (1, 96, [96])}
GRID = [  # overrides of the default config's long path (DEFAULT_CONFIG); the first is the default
    {},
    {"block_m_long": 128, "block_n_long": 64, "num_warps_long": 8, "num_stages_long": 3, "tma_long": False},
    {"tma_long": True},  # bf16: the default tiles with TMA
    {"tma_long": False},  # e4m3: the default tiles without TMA
    {"block_n_long": 128, "num_stages_long": 2},
    {"block_m_long": 64, "num_warps_long": 4, "num_stages_long": 3},  # one warpgroup per program, 2 per SM
    {"block_m_long": 64, "num_warps_long": 4, "num_stages_long": 3, "tma_long": True},
    {"block_m_long": 64, "num_warps_long": 4, "num_stages_long": 2, "block_n_long": 128, "tma_long": True},
    {"e4m3_qk_long": False},  # e4m3: exact queries, K converted for the QK dot
    {
        "e4m3_qk_long": False,
        "block_m_long": 64,
        "num_warps_long": 4,
        "num_stages_long": 2,
        "block_n_long": 128,
        "tma_long": True,
    },
]
SMALL_GRID = [{"block_m_long": 32, "block_n_long": 16, "tma_long": False},
              {"block_m_long": 32, "block_n_long": 16, "tma_long": True}]  # fmt: skip


def run_config(case: Case, planes: dict, config: SdpaConfig) -> dict:
    """µs, TFLOP/s and max abs error of one config on one case and store. Where QK^T runs as an e4m3 dot
    (e4m3 codes, 16-bit q) the reference takes the queries rounded as the kernel rounds them (every row
    here is a prompt chunk's), as tests/test_fp8_qk_long.py checks it: the rounding is the variant's."""
    scales = {"k_scale": planes.get("k_scale"), "v_scale": planes.get("v_scale")}
    out = torch.empty_like(case.q)
    calls = [lambda j=j: sdpa_varlen(case.q, planes["k"], planes["v"], case.tables[j % case.rot], out=out,
                                     config=config, **scales) for j in range(case.calls)]  # fmt: skip
    got = calls[0]().float()
    e4m3_dots = "k_scale" in planes and config.e4m3_qk_long and case.q.dtype != torch.float32
    q_ref = dequantize_fp8(*quantize_queries(case.q)) if e4m3_dots else case.q
    ref = sdpa_varlen_reference(q_ref, planes["k"], planes["v"], case.tables[0], **scales).float()
    err = float((got - ref).abs().max())
    if not err < TOLERANCE:
        raise RuntimeError(f"max abs error {err:.3g} against the reference")
    us, timing = time_calls(calls)
    return {"us": round(us, 2), "tflops": round(case.flops / us / 1e6, 1), "max_abs_err": float(f"{err:.3g}"),
            "timing": timing}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--small", action="store_true", help="CPU smoke: tiny shapes, the interpreter")
    parser.add_argument("--e4m3", type=int, nargs="*", default=None,
                        help="grid rows (0-based) also run on the e4m3 store (default: all)")  # fmt: skip
    parser.add_argument("--only", type=int, nargs="*", default=None, help="grid rows to run (default: all)")
    parser.add_argument("--cases", nargs="*", default=None, help="case names (default: all)")
    parser.add_argument("--profile", action="store_true",
                        help="for a profiler (ncu): each row and case called twice (compile, then the one to read), "
                             "untimed and unchecked, in the printed order")  # fmt: skip
    args = parser.parse_args()
    geo, table, grid = (SMALL, SMALL_CASES, SMALL_GRID) if args.small else (FULL, CASES, GRID)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size if torch.cuda.is_available() else 1 << 20
    gen = torch.Generator().manual_seed(0)
    cases = {n: Case(n, *spec, geo, l2, gen) for n, spec in table.items()}  # all built: the same lengths and columns
    cases = {n: c for n, c in cases.items() if args.cases is None or n in args.cases}
    k = torch.randn(geo.rows, geo.columns, geo.hkv, geo.d, device=geo.device, dtype=geo.dtype)
    v = torch.randn_like(k)
    (k8, k_scale), (v8, v_scale) = e4m3_store(k), e4m3_store(v)
    stores = {"bf16": {"k": k, "v": v}, "e4m3": {"k": k8, "v": v8, "k_scale": k_scale, "v_scale": v_scale}}
    dev = torch.device(geo.device)
    report: dict = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "shapes": {
            "Hq": geo.hq,
            "Hkv": geo.hkv,
            "D": geo.d,
            "dtype": str(geo.dtype).removeprefix("torch."),
            "columns": geo.columns,
            "rows": geo.rows,
        },
        "cases": {
            n: {
                "lengths": c.lengths,
                "q_len": c.q_len,
                "flops": c.flops,
                "rotations": c.rot,
                "calls_per_graph": c.calls,
            }
            for n, c in cases.items()
        },
        "default": {
            kind: resolve_config(None, geo.d, s["k"].dtype, geo.hkv, dev, geo.dtype != torch.float32).__dict__
            for kind, s in stores.items()
        },
        "grid": [],
    }
    start = time.perf_counter()
    for i, overrides in enumerate(grid):
        if args.only is not None and i not in args.only:
            continue
        config = replace(DEFAULT_CONFIG, **overrides)
        kinds = ["bf16"] + (["e4m3"] if args.e4m3 is None or i in args.e4m3 else [])
        if args.profile:
            for kind in kinds:
                for name, case in cases.items():
                    planes = stores[kind]
                    for _ in range(2):
                        sdpa_varlen(case.q, planes["k"], planes["v"], case.tables[0], config=config,
                                    k_scale=planes.get("k_scale"), v_scale=planes.get("v_scale"))  # fmt: skip
                    torch.cuda.synchronize()
                    print(f"profiled: row {i} {kind} {name} {json.dumps(overrides)}", flush=True)
            continue
        row: dict = {"config": overrides, "bf16": {}, "e4m3": {}, "errors": {}}
        report["grid"].append(row)
        for kind in kinds:
            for name, case in cases.items():
                try:
                    row[kind][name] = run_config(case, stores[kind], config)
                except Exception as exc:  # recorded; the grid goes on
                    row["errors"][f"{kind} {name}"] = f"{type(exc).__name__}: {exc}"[:400]
        print(f"{i:2d} {json.dumps(overrides):92s} " + " ".join(
            f"{kind}:{n}={r['us']}" for kind in kinds for n, r in row[kind].items()) + f" {row['errors'] or ''}"
            f" ({time.perf_counter() - start:.0f} s)", flush=True)  # fmt: skip
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
