"""sdpa_varlen over the two store layouts, in one run: does the extent pool read as fast as columns?

The engine's store was a column store, [rows, C, Hkv, D] with a sequence's position p at [p, col]
(a sequence's rows C * Hkv * D elements apart); it is now a pool of extents, [P, 1, Hkv, D] with
position p of a sequence at row `base + p` (its rows Hkv * D elements apart, the whole sequence
contiguous). The kernel is the same; only the strides and the table's `col` differ. This times
bench/kernel_cases.py's cases (seed 0: the same lengths) on both, CUDA-graph replay, calls rotating
over several data copies as bench/kernels.py does, and checks both against the torch reference.

    python3 bench/pool_layout.py --out bench/results/pool-layout-h200.json   # on the H200
    python bench/pool_layout.py --small --out /tmp/pool.json                  # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ceilings import read_ceiling
from kernel_cases import CASES, SMALL_CASES, Case, build_cases
from timing import time_calls

from batchkv.ops import sdpa_varlen, sdpa_varlen_reference

DEFAULT = ["b1-l1024", "b1-l4096", "b1-l16384", "b8-mixed", "b32-mixed", "b64-mixed", "b64-l512", "b32-verify4",
           "prefill-4x512"]  # fmt: skip


def pool_of(case: Case, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """The same keys as the column store, moved into a pool: every rotation's sequences get extents of
    their length, placed one after another in a shuffled order (so neighbours are unrelated), and
    tables whose `col` is the extent's first row."""
    gen = torch.Generator().manual_seed(1)
    extents = [(j, b) for j in range(case.rot) for b in range(case.batch)]
    order = torch.randperm(len(extents), generator=gen).tolist()
    base, at = {}, 0
    for i in order:
        base[extents[i]] = at
        at += case.lengths[extents[i][1]]
    pk = torch.empty(at, 1, *k.shape[2:], device=k.device, dtype=k.dtype)
    pv = torch.empty_like(pk)
    tables = []
    for j, cols in enumerate(case.cols):
        info = case.tables[j].clone()
        for b, (col, n) in enumerate(zip(cols, case.lengths, strict=True)):
            pk[base[j, b] : base[j, b] + n, 0] = k[:n, col]
            pv[base[j, b] : base[j, b] + n, 0] = v[:n, col]
            info[b, 2] = base[j, b]
        tables.append(info)
    return pk, pv, tables


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench/results/pool-layout-h200.json"))
    ap.add_argument("--small", action="store_true", help="tiny geometry and cases (a CPU smoke run)")
    args = ap.parse_args()
    torch.manual_seed(0)
    cuda = torch.cuda.is_available()
    names = list(SMALL_CASES) if args.small else [n for n in DEFAULT if n in CASES]
    geo, cases = build_cases(names, args.small, torch.cuda.get_device_properties(0).L2_cache_size if cuda else 1 << 16)
    k = torch.randn(geo.rows, geo.columns, geo.hkv, geo.d, device=geo.device, dtype=geo.dtype)
    v = torch.randn_like(k)
    read = read_ceiling(k.device)[0] if cuda else None
    report: dict = {"device": torch.cuda.get_device_name() if cuda else "cpu", "read_gbps": read, "cases": []}
    for name, case in cases.items():
        pk, pv, tables = pool_of(case, k, v)
        most = max(case.lengths)
        out = torch.empty_like(case.q)
        row: dict = {"name": name, "lengths_sum": sum(case.lengths)}
        for layout, (ks, vs, tabs, rows) in {"columns": (k, v, case.tables, None),
                                             "pool": (pk, pv, tables, most)}.items():  # fmt: skip
            got = sdpa_varlen(case.q, ks, vs, tabs[0], rows=rows)
            ref = sdpa_varlen_reference(case.q, ks, vs, tabs[0], rows=rows).float()
            calls = [lambda j=j, q=case.q, rot=case.rot, ks=ks, vs=vs, tabs=tabs, rows=rows, out=out:
                     sdpa_varlen(q, ks, vs, tabs[j % rot], out=out, rows=rows) for j in range(case.calls)]  # fmt: skip
            us, how = time_calls(calls)
            row[layout] = {"us": us, "timing": how, "max_abs_err": float((got.float() - ref).abs().max()),
                           "gbps": case.bytes / us / 1e3}  # fmt: skip
        row["pool_over_columns"] = row["pool"]["us"] / row["columns"]["us"]
        report["cases"].append(row)
        print(f"{name:14s} columns {row['columns']['us']:8.2f} us  pool {row['pool']['us']:8.2f} us  "
              f"ratio {row['pool_over_columns']:.3f}  err {row['pool']['max_abs_err']:.1e}", flush=True)  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
