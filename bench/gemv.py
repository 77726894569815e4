"""The few-row linear kernel (batchkv.models.gemv) against cuBLAS on the SenseNova-U1-8B shapes.

For each projection (q/k/v fused, o, gate/up fused, down, LM head with float32 output) and 1, 2
and 4 rows: µs per call under CUDA-graph replay (median of 50 replays of a graph holding K
back-to-back calls, rotating over weight copies so every call reads from HBM), GB/s of weights
read, % of the read ceiling measured in the same run (a bf16 sum over 4 GiB), for cuBLAS
(`F.linear`, plus the float cast where the model needs it) and for every
GemvConfig of a small grid at one row (more rows: the default and the one-row winner). The best
config per shape is printed and kept in the JSON. At one row, `after_norm` times each matmul behind
an add+RMSNorm launch, as the step runs it: cuBLAS and the winner.

    python3 bench/gemv.py --out bench/results/gemv-h200.json       # on the GPU, about a minute
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from timing import time_calls

from batchkv.models.fused import add_rms_norm, silu_mul
from batchkv.models.gemv import GemvConfig, gemv, resolve

SHAPES = {  # name: (N, K, silu_mul, out_dtype)
    "qkv": (6144, 4096, False, torch.bfloat16),
    "o_proj": (4096, 4096, False, torch.bfloat16),
    "gate_up": (24576, 4096, False, torch.bfloat16),
    "down": (4096, 12288, False, torch.bfloat16),  # the model feeds it silu_mul's output
    "lm_head": (151936, 4096, False, torch.float32),
}
GRID = [
    GemvConfig(block_n=bn, block_k=bk, num_warps=4, num_stages=st)
    for bn, bk, st in itertools.product((16, 32, 64), (128, 256, 512), (3, 5))
]  # swept at one row; more rows time the default and the one-row winner


def graph_us(fn, calls: int, replays: int = 50) -> float:
    """Median µs per call of fn(0), fn(1), ... fn(calls - 1) captured in one graph (bench/timing.py)."""
    return time_calls([lambda j=j: fn(j) for j in range(calls)], replays=replays)[0]


def read_gbps() -> float:
    """Read-only ceiling: a float32-accumulated sum over 4 GiB of bf16, bytes read per second / 1e9."""
    big = torch.empty(2 << 30, dtype=torch.bfloat16, device="cuda").normal_()
    return (4 << 30) / graph_us(lambda j: torch.sum(big, dtype=torch.float32), 2, 10) / 1e3


def after_norm(x: torch.Tensor, ws: list, rot: int, calls: int, config: dict, out_dtype: torch.dtype) -> dict:
    """µs per (add+RMSNorm, matmul) pair, as a decode step issues them: cuBLAS, then the kernel with the
    one-row winner's tiles."""
    h, w_norm = torch.randn_like(x), torch.ones(x.shape[1], device="cuda", dtype=x.dtype)
    cfg = GemvConfig(**config)
    kernel = lambda a, w: gemv(a, w, out_dtype=out_dtype, config=cfg)  # noqa: E731
    cublas = lambda a, w: F.linear(a, w).to(out_dtype)  # noqa: E731
    out = {}
    for name, mm in (("cublas_us", cublas), ("kernel_us", kernel)):
        out[name] = round(graph_us(lambda j, mm=mm: mm(add_rms_norm(h, x, w_norm, 1e-6)[1], ws[j % rot]), calls), 2)
    print(f"  after a norm: {out}", flush=True)
    return out


def time_shape(n: int, k: int, silu: bool, out_dtype: torch.dtype, rows: list[int], ceiling: float) -> dict:
    """cuBLAS and the kernel's configs on one weight shape, for each row count."""
    nbytes = n * k * 2
    rot = max(2, -(-200 * 2**20 // nbytes))  # >= 200 MiB of weights per rotation: past the L2
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(rot)]
    calls = max(rot, 8)
    pct = lambda us: round(100 * nbytes / us / 1e3 / ceiling, 1)  # noqa: E731
    entry: dict = {"n": n, "k": k, "silu_mul": silu, "bytes": nbytes, "rows": {}}
    for m in rows:
        x = torch.randn(m, 2 * k if silu else k, device="cuda", dtype=torch.bfloat16)

        def cublas(j: int, x: torch.Tensor = x) -> torch.Tensor:
            y = F.linear(silu_mul(x) if silu else x, ws[j % rot])
            return y.float() if out_dtype == torch.float32 else y

        us = graph_us(cublas, calls)
        row = entry["rows"][m] = {"cublas": {"us": round(us, 2), "pct_of_read": pct(us)}}
        one_row = entry["rows"].get(rows[0], {}).get("best") if m != rows[0] else None
        grid = GRID if one_row is None else [GemvConfig(**one_row["config"])]
        results = []
        for cfg in [resolve(None, n, torch.device("cuda"), k), *grid]:
            try:
                us = graph_us(lambda j, x=x, cfg=cfg: gemv(x, ws[j % rot], out_dtype=out_dtype, config=cfg),
                              calls)  # fmt: skip
            except Exception as exc:  # a config that does not compile is recorded, not fatal
                results.append({"config": cfg.__dict__, "error": f"{type(exc).__name__}: {exc}"[:200]})
                continue
            results.append({"config": cfg.__dict__, "us": round(us, 2), "pct_of_read": pct(us)})
        ok = [r for r in results if "us" in r]
        row.update(default=results[0], best=min(ok, key=lambda r: r["us"]) if ok else None, grid=results[1:])
        if ok and m == rows[0]:
            row["after_norm"] = after_norm(x, ws, rot, calls, row["best"]["config"], out_dtype)
        best = row["best"] or {}
        print(f"  rows {m}: cuBLAS {row['cublas']['us']:7.2f} us ({row['cublas']['pct_of_read']}%) | default "
              f"{row['default'].get('us')} | best {best.get('us')} us ({best.get('pct_of_read')}%) "
              f"{best.get('config')}", flush=True)  # fmt: skip
    return entry


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("bench/results/gemv-h200.json"))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4])
    args = ap.parse_args()
    torch.manual_seed(0)
    ceiling = read_gbps()
    report: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "read_gbps": ceiling,
                    "method": "median of 50 graph replays / calls per graph; weights rotate past the L2",
                    "shapes": {}}  # fmt: skip
    print(f"read ceiling {ceiling:.0f} GB/s")
    for name, (n, k, silu, out_dtype) in SHAPES.items():
        print(name, flush=True)
        report["shapes"][name] = time_shape(n, k, silu, out_dtype, args.rows, ceiling)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
