"""qk_norm_rope's kernel against an earlier version of it: bitwise equality and time per call.

The earlier version is a copy of `batchkv/models/fused.py` from another commit, given by path
(`git show REV:batchkv/models/fused.py > old.py`). Shapes are the 8B preset's (32 q heads, 8 KV
heads, head_dim 128) at the step widths serving runs; each call is timed inside a CUDA graph of
`CALLS` calls (`timing.time_calls`). The block kernel reduces its sums of squares in another order,
so a few outputs differ by a bf16 ulp.

    git show 803e9ae~1:batchkv/models/fused.py > /tmp/fused_old.py
    python3 bench/qk_norm_rope_ab.py --old /tmp/fused_old.py --out bench/results/qk-norm-rope-h200.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from timing import time_calls

from batchkv.models import fused
from batchkv.models.sensenova import Rope3D

CALLS = 32  # calls per captured graph: the kernel's time, not Python's launch cost
BUDGET_S = 5.0  # enough for every replay asked (--iters) at these sizes


def load(path: Path):
    spec = importlib.util.spec_from_file_location("fused_old", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def per_call(module, call: tuple, iters: int) -> float:
    """µs of one `module.qk_norm_rope(*call)` in a CUDA graph of `CALLS` of them (median of `iters` replays)."""
    us, how = time_calls([lambda: module.qk_norm_rope(*call)] * CALLS, iters, BUDGET_S)
    assert how == "graph", how  # an eager timing would be Python's launch cost
    return us


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", type=Path, required=True, help="an earlier batchkv/models/fused.py")
    ap.add_argument("--out", type=Path, default=Path("bench/results/qk-norm-rope-h200.json"))
    ap.add_argument("--widths", default="1,64,256,768,1280")
    ap.add_argument("--iters", type=int, default=200)
    args = ap.parse_args()
    old, dev = load(args.old), torch.device("cuda")
    q_heads, kv_heads, d, dtype = 32, 8, 128, torch.bfloat16
    rope = Rope3D(d, 5e6, 1e4)
    g = torch.Generator(device=dev).manual_seed(0)
    q_norm, k_norm = (torch.randn(2, d // 2, generator=g, device=dev).to(dtype) for _ in range(2))
    rows = []
    for width in (int(w) for w in args.widths.split(",")):
        qkv = (torch.randn(width, (q_heads + 2 * kv_heads) * d, generator=g, device=dev) * 3).to(dtype)
        t = torch.arange(width) + 100
        cos, sin = (table.to(dev) for table in rope.tables(torch.stack([t, t % 7, t % 5]), dtype))
        call = (qkv, q_norm, k_norm, cos, sin, rope.partner.to(dev), q_heads, kv_heads, 1e-6)
        new_q, new_k = fused.qk_norm_rope(*call)
        old_q, old_k = old.qk_norm_rope(*call)
        new, was = torch.cat([new_q, new_k], 1).float(), torch.cat([old_q, old_k], 1).float()
        ulp = (torch.finfo(dtype).eps * was.abs().clamp_min(torch.finfo(dtype).tiny)).float()
        row = {"width": width, "bitwise_equal": bool(torch.equal(new, was)),
               "differing_fraction": (new != was).float().mean().item(),
               "max_diff_in_ulps": ((new - was).abs() / ulp).max().item(),
               "old_us": per_call(old, call, args.iters), "new_us": per_call(fused, call, args.iters)}  # fmt: skip
        # q and k heads in and out, and the two tables
        row["bytes_moved"] = 2 * (q_heads + kv_heads) * d * width * dtype.itemsize + 2 * cos.nbytes
        row["new_gbps"] = row["bytes_moved"] / row["new_us"] / 1e3
        rows.append(row)
        print(row, flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
                                    "shape": {"q_heads": q_heads, "kv_heads": kv_heads, "head_dim": d, "dtype": "bf16"},
                                    "old": str(args.old), "rows": rows}, indent=2) + "\n")  # fmt: skip


if __name__ == "__main__":
    main()
