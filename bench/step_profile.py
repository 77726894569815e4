"""Where one decode step's device time goes: kernel time by kind for a SenseNova step on CUDA.

Runs one eager forward of a prepared decode step under torch.profiler and sums CUDA kernel time by
kind (matmuls, attention, the K/V write, fused norm/RoPE/SiLU kernels, other elementwise work).
Kernel durations are the same inside a CUDA graph; what a graph removes is the launch gaps between
them, so (graph step time - kernel total) is what is left for gaps and the host.

    python3 bench/step_profile.py --rows 1 --context 640        # on the GPU
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batchkv.cache import BatchedSequenceCache, CacheConfig
from batchkv.models import build_model

KINDS = (  # first match wins; matched against the lower-cased kernel name
    ("attention", ("split_kernel", "long_kernel", "splitkv_", "sdpa")),
    ("kv_write", ("kv_write",)),
    ("fused_norm_rope_silu", ("_add_rms_norm", "_qk_norm_rope", "_silu_mul")),
    ("matmul", ("gemm", "gemv", "cutlass", "sm90", "nvjet", "xmma", "cublas")),
    ("embedding_gather", ("index", "gather", "embedding")),
)


def kind_of(name: str) -> str:
    lower = name.lower()
    return next((kind for kind, keys in KINDS if any(k in lower for k in keys)), "other")


def profile_step(preset: str, rows: int, context: int, device: torch.device) -> dict:
    model = build_model(preset, device, seed=0)
    cfg = CacheConfig(**model.cache_spec(), max_seqs=max(rows, 1), capacity=context + 8, max_write=1)
    cache = BatchedSequenceCache(cfg, device)
    seqs = [cache.seq_new(reach=context + 1) for _ in range(rows)]
    for seq in seqs:
        cache._set_length(seq, context)  # histories of `context` positions (their K/V content is irrelevant)
    cache.declare_step(seqs)
    cache.prepare_step(rows)
    ids = torch.zeros(rows, dtype=torch.long, device=device)
    indexes = torch.zeros(3, rows, dtype=torch.long, device=device)
    select = torch.arange(rows, device=device)
    for _ in range(3):
        model(ids, indexes, cache, select)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        model(ids, indexes, cache, select)
        torch.cuda.synchronize()
    by_kind: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kind = kind_of(event.name)
            by_kind[kind] += event.device_time_total / 1e3  # ms
            count[kind] += 1
    total = sum(by_kind.values())
    return {
        "preset": preset,
        "rows": rows,
        "context": context,
        "kernel_ms_total": round(total, 4),
        "kernel_ms_by_kind": {k: round(v, 4) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "kernels_by_kind": dict(count),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="sensenova-u1-8b")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--context", type=int, default=640)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    results = [profile_step(args.preset, r, args.context, torch.device("cuda")) for r in args.rows]
    for r in results:
        parts = ", ".join(f"{k} {v:.3f}" for k, v in r["kernel_ms_by_kind"].items())
        print(f"rows {r['rows']:3d} context {r['context']}: kernels {r['kernel_ms_total']:.3f} ms ({parts})")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
