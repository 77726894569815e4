"""Model-only decode step time against the weight-read roofline.

Runs `model(input_ids, indexes, cache, logits_rows)` for W = R rows (one decode token per
sequence) with a stand-in cache whose attention returns q, so the number is the model's own cost:
every weight matrix read once, plus the small kernels around them. On CUDA each width is captured
in a CUDA graph and replayed; the roofline is the weight bytes of one step over the measured
device-to-device copy bandwidth (read + write bytes over time) of the same run.

    python bench/model_step.py --preset sensenova-u1-8b --rows 1 8 32 64          # on the GPU

Each width is timed twice on CUDA: as the model runs (the few-row kernel of batchkv.models.gemv at
up to GEMV_MAX_ROWS rows) and with every matmul on cuBLAS; `kernels` counts the kernels one eager
step launches (= the nodes of its graph), from the profiler.
    python bench/model_step.py --preset sensenova-u1-tiny --device cpu --iters 3   # smoke test
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import batchkv.models.gemv as gemv_module
from batchkv.models import build_model


class NullAttention:
    """Stands in for the cache: attention returns q (capturable, no KV traffic)."""

    def update_and_attend(self, layer, q, k, v, scale=None, causal=True):
        return q


def copy_peak_gbs(device: torch.device, nbytes: int = 2 << 30) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 2 * nbytes * 10 / (start.elapsed_time(end) / 1e3) / 1e9


def step_ms(model, rows: int, iters: int) -> float:
    dev = model.device
    ids = torch.randint(0, model.vocab_size, (rows,), device=dev)
    idx = torch.zeros(3, rows, dtype=torch.int64, device=dev)
    idx[0] = torch.arange(rows, device=dev) + 100
    sel = torch.arange(rows, device=dev)
    cache = NullAttention()
    if dev.type != "cuda":
        model(ids, idx, cache, sel)
        t0 = time.perf_counter()
        for _ in range(iters):
            model(ids, idx, cache, sel)
        return (time.perf_counter() - t0) / iters * 1e3
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            model(ids, idx, cache, sel)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        model(ids, idx, cache, sel)
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def kernels_per_step(model, rows: int) -> int:
    """Kernels one eager step launches (each is a node of the captured graph)."""
    from torch.profiler import ProfilerActivity, profile

    dev = model.device
    ids = torch.zeros(rows, dtype=torch.int64, device=dev)
    idx = torch.zeros(3, rows, dtype=torch.int64, device=dev)
    sel = torch.arange(rows, device=dev)
    model(ids, idx, NullAttention(), sel)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        model(ids, idx, NullAttention(), sel)
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type.name == "CUDA")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="sensenova-u1-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    device = torch.device(args.device)
    with torch.inference_mode():
        t0 = time.perf_counter()
        model = build_model(args.preset, device)
        built_s = time.perf_counter() - t0
        cfg = model.config
        elem = torch.empty((), dtype=model.dtype).element_size()
        weight_bytes = (cfg.num_params - cfg.vocab * cfg.hidden) * elem  # the embedding reads W rows only
        peak = copy_peak_gbs(device) if device.type == "cuda" else float("nan")
        print(
            f"{args.preset} on {device}: {cfg.num_params / 1e9:.2f} B params, {weight_bytes / 1e9:.2f} GB read "
            f"per step, built in {built_s:.1f} s, copy peak {peak:.0f} GB/s"
        )
        results = []
        for rows in args.rows:
            ms = step_ms(model, rows, args.iters)
            gbs = weight_bytes / (ms / 1e3) / 1e9
            roof_ms = weight_bytes / (peak * 1e9) * 1e3
            results.append({"rows": rows, "ms": ms, "weight_gbs": gbs, "roofline_ms": roof_ms})
            if device.type == "cuda" and rows <= gemv_module.GEMV_MAX_ROWS:
                results[-1]["kernels"] = kernels_per_step(model, rows)
                limit, gemv_module.GEMV_MAX_ROWS = gemv_module.GEMV_MAX_ROWS, 0  # every matmul on cuBLAS
                results[-1]["cublas_ms"] = step_ms(model, rows, args.iters)
                results[-1]["cublas_kernels"] = kernels_per_step(model, rows)
                gemv_module.GEMV_MAX_ROWS = limit
                print(
                    f"  rows {rows:3d}: cuBLAS only {results[-1]['cublas_ms']:8.3f} ms/step; kernels per step "
                    f"{results[-1]['kernels']} (cuBLAS only {results[-1]['cublas_kernels']})"
                )
            print(
                f"  rows {rows:3d}: {ms:8.3f} ms/step  {gbs:7.0f} GB/s  roofline {roof_ms:.3f} ms "
                f"({100 * roof_ms / ms:.0f}% of it)  {rows / ms * 1e3:9.0f} tokens/s"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"preset": args.preset, "device": str(device), "copy_peak_gbs": peak, "steps": results}, f)


if __name__ == "__main__":
    main()
