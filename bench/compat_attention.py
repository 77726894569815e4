"""Attention of one SenseNova-U1 decode step, 42 layers, under CUDA graph replay: batchkv vs SDPA.

At SenseNova-U1-8B shapes (Hq 32, Hkv 8, head_dim 128, bf16) and decode lengths 1024 and 9100,
each option runs the attention of all 42 layers inside one captured CUDA graph, timed as the
median of >= 100 replays (CUDA events around each replay):

- batchkv: `PagedDecodeCache.attend` per layer (single-sequence mode: writes the step's K/V, then
  `sdpa_varlen` over [0, length) of a bucket-sized store; length read from device tensors).
- batchkv_fused_write: the same with `SdpaConfig.fuse_write` in the default's narrow config (the
  step's K/V stored by split_merge's partials kernel instead of a kv_write launch).
- sdpa_exact: torch SDPA over exactly `length` keys. This is what an eager DynamicCache step reads;
  a graph cannot follow its growing shape, so it is the speed bar rather than a capturable option.
- sdpa_bucket_mask: torch SDPA over the whole bucket with a boolean mask: capturable, and the
  option the original pipeline measured at 7.96-11.55 ms against 1.03 ms exact on an A800.

Target: batchkv at most half the exact-prefix SDPA time (`ratio_vs_exact <= 0.5`). GB/s counts
the K/V bytes of the valid prefix (what an ideal kernel reads), so it compares across options.
A failing option is recorded in the case's `errors` and the run goes on.

    PYTHONPATH=$PWD python bench/compat_attention.py [--lengths 1024 9100] [--out bench/results/compat-h200.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import traceback
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from batchkv.cache.single import bucket_for
from batchkv.compat import PagedDecodeCache
from batchkv.ops import sdpa_varlen_triton

LAYERS, HQ, HKV, D = 42, 32, 8, 128
OPTIONS = ("batchkv", "batchkv_fused_write", "sdpa_exact", "sdpa_bucket_mask")


def capture(fn: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """Warm up on a side stream (Triton compiles, cuBLAS/SDPA workspaces), then capture `fn`."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph


def replay_us(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """Median microseconds of one replay over `replays` replays, after 10 unrecorded ones."""
    for _ in range(10):
        graph.replay()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events) * 1000.0


def step_inputs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This step's q [1, Hq, 1, D] and k, v [1, Hkv, 1, D], as the pipeline's attention holds them."""
    return (
        torch.randn(1, HQ, 1, D, device="cuda", dtype=dtype),
        torch.randn(1, HKV, 1, D, device="cuda", dtype=dtype),
        torch.randn(1, HKV, 1, D, device="cuda", dtype=dtype),
    )


def bench_batchkv(length: int, dtype: torch.dtype, replays: int, fuse_write: bool = False) -> tuple[float, int]:
    if fuse_write:  # the default config with the narrow config's write fused, for this option only
        default = sdpa_varlen_triton.DEFAULT_CONFIG
        sdpa_varlen_triton.DEFAULT_CONFIG = replace(default, narrow=replace(default.narrow, fuse_write=True))
        try:
            return bench_batchkv(length, dtype, replays)
        finally:
            sdpa_varlen_triton.DEFAULT_CONFIG = default
    paged = PagedDecodeCache(LAYERS, HKV, D, length, "cuda", dtype)
    for layer in range(LAYERS):
        paged.inner.k_store(layer).normal_()
        paged.inner.v_store(layer).normal_()
    paged.set_length(length)
    q, k, v = step_inputs(dtype)
    scale = D**-0.5

    def step():
        return [paged.attend(layer, q, k, v, scale) for layer in range(LAYERS)]

    return replay_us(capture(step), replays), paged.bucket


def sdpa_step(keys, values, q, mask) -> Callable[[], list[torch.Tensor]]:
    """42 layers of SDPA; GQA by `enable_gqa`, or over K/V already expanded to Hq heads."""
    gqa = keys[0].shape[1] != HQ

    def step():
        return [
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=D**-0.5, enable_gqa=gqa)
            for k, v in zip(keys, values, strict=True)
        ]

    return step


def bench_sdpa(rows: int, length: int, dtype: torch.dtype, replays: int, notes: list[str]) -> float:
    """SDPA over `rows` keys per layer; a boolean mask keeps [0, length) when rows > length."""
    q, _, _ = step_inputs(dtype)
    mask = None
    if rows > length:
        mask = (torch.arange(rows, device="cuda") < length).view(1, 1, 1, rows)
    heads = HKV
    for attempt in range(2):
        keys = [torch.randn(1, heads, rows, D, device="cuda", dtype=dtype) for _ in range(LAYERS)]
        values = [torch.randn(1, heads, rows, D, device="cuda", dtype=dtype) for _ in range(LAYERS)]
        try:
            return replay_us(capture(sdpa_step(keys, values, q, mask)), replays)
        except RuntimeError as exc:
            if attempt:
                raise
            notes.append(f"enable_gqa failed ({str(exc).splitlines()[0][:120]}); K/V expanded to {HQ} heads")
            heads = HQ
            del keys, values
            torch.cuda.empty_cache()
    raise AssertionError("unreachable")


def run_case(length: int, dtype: torch.dtype, replays: int) -> dict:
    elem = torch.empty((), dtype=dtype).element_size()
    kv_bytes = 2 * LAYERS * length * HKV * D * elem
    case: dict = {"length": length, "bucket": None, "kv_bytes": kv_bytes, "errors": {}, "notes": []}
    timings = {}
    for name in OPTIONS:
        try:
            if name.startswith("batchkv"):
                timings[name], case["bucket"] = bench_batchkv(length, dtype, replays, name == "batchkv_fused_write")
            elif name == "sdpa_exact":
                timings[name] = bench_sdpa(length, length, dtype, replays, case["notes"])
            else:
                bucket = case["bucket"] or bucket_for(length)
                timings[name] = bench_sdpa(bucket, length, dtype, replays, case["notes"])
        except Exception as exc:  # record and go on: one broken option must not hide the others
            case["errors"][name] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            traceback.print_exc()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    case["bucket"] = case["bucket"] or bucket_for(length)
    for name in OPTIONS:
        us = timings.get(name)
        case[f"{name}_us"] = round(us, 2) if us is not None else None
        case[f"{name}_gbps"] = round(kv_bytes / us / 1e3, 1) if us else None
    exact, ours = timings.get("sdpa_exact"), timings.get("batchkv")
    case["ratio_vs_exact"] = round(ours / exact, 3) if ours and exact else None
    case["meets_target"] = case["ratio_vs_exact"] is not None and case["ratio_vs_exact"] <= 0.5
    fused = timings.get("batchkv_fused_write")
    case["fused_write_ratio_vs_exact"] = round(fused / exact, 3) if fused and exact else None
    return case


def show(value, width: int) -> str:
    return f"{'-' if value is None else value:>{width}}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 9100])
    parser.add_argument("--replays", type=int, default=200, help="timed replays per option (at least 100)")
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    parser.add_argument("--out", default="bench/results/compat-h200.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("compat_attention: needs a CUDA GPU (run it on the H200)", file=sys.stderr)
        return 2
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    replays = max(100, args.replays)
    torch.manual_seed(0)
    cases = [run_case(length, dtype, replays) for length in args.lengths]
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "shapes": {"layers": LAYERS, "q_heads": HQ, "kv_heads": HKV, "head_dim": D, "dtype": args.dtype},
        "replays": replays,
        "statistic": "median microseconds per replay of one graph holding all 42 layers",
        "target": "batchkv_us <= 0.5 * sdpa_exact_us",
        "cases": cases,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{result['device']}, {LAYERS} layers, Hq {HQ}, Hkv {HKV}, D {D}, {args.dtype}; median of {replays}")
    header = (f"{'length':>7} {'bucket':>7} {'batchkv us':>11} {'fused us':>9} {'exact us':>9} {'mask us':>9} "
              f"{'ratio':>6} {'GB/s':>7}")  # fmt: skip
    print(header)
    for c in cases:
        print(
            f"{c['length']:>7} {show(c['bucket'], 7)} {show(c['batchkv_us'], 11)} "
            f"{show(c['batchkv_fused_write_us'], 9)} {show(c['sdpa_exact_us'], 9)} "
            f"{show(c['sdpa_bucket_mask_us'], 9)} {show(c['ratio_vs_exact'], 6)} {show(c['batchkv_gbps'], 7)}"
        )
        for name, error in c["errors"].items():
            print(f"        {name} failed: {error}")
    print(f"wrote {out}")
    return 0 if all(not c["errors"] for c in cases) else 1


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:
        return None


if __name__ == "__main__":
    raise SystemExit(main())
