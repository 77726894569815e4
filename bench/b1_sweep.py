"""sdpa_varlen for one decoding sequence (T = 1): a grid of SdpaConfig choices beside SDPA exact prefix.

One sequence is latency-bound, not bandwidth-bound: the launch, the prologue, a short pipelined loop
and the merge of the partials set its time. This times every config of GRID at 16, 256, 1,024, 4,096,
9,100 and 16,384 keys (Hq 32, Hkv 8, D 128, bf16, a 2-column store of 16,384 rows, so the shapes are the
single-sequence facade's), each the median of 100 CUDA-graph replays of 16 back-to-back calls, one
per copy of the store, so the data comes from HBM, not the L2. SDPA over the exact prefix with
enable_gqa (its flash and efficient backends, the faster kept) is timed the same way. Each config is
checked against the torch reference first. Writes every row as it goes.

    python3 bench/b1_sweep.py --out bench/results/b1-sweep-h200.json     # on the GPU, ~1-2 minutes
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from timing import time_calls

from batchkv.ops import sdpa_varlen_reference
from batchkv.ops.sdpa_varlen_triton import SdpaConfig, sdpa_varlen

HQ, HKV, D, ROWS, COPIES = 32, 8, 128, 16384, 16
LENGTHS = (16, 256, 1024, 4096, 9100, 16384)  # 16 and 256: the fixed cost (launch, prologue, merge)
GRID = [{}, {"min_blocks": 1 << 20}] + [  # min_blocks 2^20: one program per head, no merge
    {"occupancy": occ, "block_n": bn, "num_stages": st, "min_blocks": mb}
    for occ, bn, st, mb in itertools.product((1, 2, 4), (32, 64), (2, 3), (1, 2))
]


def graph_us(calls, replays: int = 100) -> float:
    """Median µs per call of `calls` captured in one graph (bench/timing.py)."""
    return time_calls(calls, replays=replays)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("bench/results/b1-sweep-h200.json"))
    args = ap.parse_args()
    torch.manual_seed(0)
    stores = [(torch.randn(ROWS, 1, HKV, D, device="cuda", dtype=torch.bfloat16),
               torch.randn(ROWS, 1, HKV, D, device="cuda", dtype=torch.bfloat16)) for _ in range(COPIES)]  # fmt: skip
    q = torch.randn(1, HQ, D, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    report: dict = {"device": torch.cuda.get_device_name(), "lengths": LENGTHS, "sdpa_exact": {}, "rows": []}
    for n in LENGTHS:
        info = torch.tensor([[0, 1, 0, n]], dtype=torch.int32, device="cuda")
        qq = q.transpose(0, 1)[None]  # [1, Hq, 1, D]
        prefixes = [(k[:n, 0].transpose(0, 1)[None].contiguous(), v[:n, 0].transpose(0, 1)[None].contiguous())
                    for k, v in stores]  # fmt: skip
        best = None
        for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
            try:
                with torch.nn.attention.sdpa_kernel(backend):
                    calls = [lambda k=k, v=v, qq=qq: F.scaled_dot_product_attention(qq, k, v, enable_gqa=True)
                             for k, v in prefixes]  # fmt: skip
                    us = graph_us(calls)
                if best is None or us < best[0]:
                    best = (us, backend.name)
            except Exception as exc:  # a backend that refuses the shape is skipped
                print(f"sdpa {backend.name} at {n}: {type(exc).__name__}")
        report["sdpa_exact"][n] = {"us": round(best[0], 2), "backend": best[1]} if best else None
        print(f"{n:6d} keys: SDPA exact {report['sdpa_exact'][n]}", flush=True)
    for overrides in GRID:
        row = {"config": overrides, "us": {}}
        try:
            cfg = SdpaConfig(**overrides)
            for n in LENGTHS:
                info = torch.tensor([[0, 1, 0, n]], dtype=torch.int32, device="cuda")
                err = (sdpa_varlen(q, *stores[0], info, config=cfg).float() - ref_of(q, stores[0], info)).abs().max()
                if not err < 3e-2:
                    raise RuntimeError(f"max error {err.item()} at {n} keys")
                calls = [lambda k=k, v=v, info=info, cfg=cfg: sdpa_varlen(q, k, v, info, out=out, config=cfg)
                         for k, v in stores]  # fmt: skip
                row["us"][n] = round(graph_us(calls), 2)
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"[:200]
            torch.cuda.synchronize()
        report["rows"].append(row)
        print(json.dumps(row), flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    ok = [r for r in report["rows"] if len(r["us"]) == len(LENGTHS)]
    report["best_by_sum"] = min(ok, key=lambda r: sum(r["us"].values())) if ok else None
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print("best:", report["best_by_sum"])


def ref_of(q, store, info):
    return sdpa_varlen_reference(q, *store, info).float()


if __name__ == "__main__":
    main()
