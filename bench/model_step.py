"""Model-only decode step time against the weight-read roofline.

Runs `model(input_ids, indexes, cache, logits_rows)` for W = R rows (one decode token per
sequence) with a stand-in cache whose attention returns q, so the number is the model's own cost:
every weight matrix read once, plus the small kernels around them. On CUDA each width is captured
in a CUDA graph and replayed; the roofline is the weight bytes of one step over the measured
device-to-device copy bandwidth (read + write bytes over time; bench/lib/ceilings.py) of the same run.

    python bench/model_step.py --preset sensenova-u1-8b --rows 1 8 32 64          # on the GPU

Each width is timed twice on CUDA: as the model runs (the few-row kernel of batchkv.models.gemv at
up to GEMV_MAX_ROWS rows) and with every matmul on cuBLAS; `kernels` counts the kernels one eager
step launches (= the nodes of its graph), from the profiler.
    python bench/model_step.py --preset sensenova-u1-tiny --device cpu --iters 3   # smoke test

`--quantization fp8` times the model with e4m3 projections (`batchkv.models.quant`). `--fp8-matmuls`
times the decoder's matmuls of one step alone (every layer's q/k/v, o, gate/up and down, each with
its own weights, so every weight is read from HBM), bf16 (as the model runs them: the few-row kernel
at up to GEMV_MAX_ROWS rows, cuBLAS above) against fp8 (the activation quantiser and the e4m3 product,
as `Fp8Linear` runs them), each captured in one CUDA graph, at each of `--rows`; with the variants
`fp8_exact_accum` (the scaled matmul without fast accumulation), `fp8_rowwise_only` (no product
through the unscaled GEMM and `apply_scales`: fp8's TENSORWISE rule off), at few rows `fp8_scaled_mm` (the scaled
matmul instead of the e4m3 few-row kernel) and `bf16_cublas`, and up to 128 rows `fp8_triton` (the
few-row kernel with every row in one tile).
    python bench/model_step.py --fp8-matmuls --rows 1 64 256 1024 --json out.json      # on the GPU

`--fusion-ab` times the step of a transformers Llama of the Llama-3.1-8B shape (random weights, through
`HFModel`, attention stood in for as above, logits of every row) with q/k/v and gate/up as the model
has them (three and two GEMMs a layer) against fused (`batchkv.models.hf_fuse`: one each), in bf16 and
in fp8, at each of `--rows`; `--fusion-small` is a tiny Llama (the CPU smoke run).
    python bench/model_step.py --fusion-ab --rows 1 64 256 1024 --json out.json          # on the GPU
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout: bench.lib and batchkv
import batchkv.models.gemv as gemv_module
import batchkv.models.quant.fp8 as fp8_module
import batchkv.models.quant.producers as producers
from batchkv.models import build_model, preset_config
from batchkv.models.quant import Fp8Linear
from bench.lib.ceilings import copy_ceiling
from bench.lib.timing import time_calls


class NullAttention:
    """Stands in for the cache: attention returns q (capturable, no KV traffic)."""

    def update_and_attend(self, layer, q, k, v, scale=None, causal=True):
        return q


def step_ms(model, rows: int, iters: int) -> float:
    """Mean ms of one decoder step of `rows` rows (attention left out), replayed from one CUDA graph."""
    dev = model.device
    ids = torch.randint(0, model.vocab_size, (rows,), device=dev)
    idx = torch.zeros(3, rows, dtype=torch.int64, device=dev)
    idx[0] = torch.arange(rows, device=dev) + 100
    sel = torch.arange(rows, device=dev)
    cache = NullAttention()
    return graph_ms(lambda: model(ids, idx, cache, sel), iters, dev)


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


def graph_ms(fn, iters: int, device: torch.device) -> float:
    """ms of `fn()`: the median of `iters` replays of one CUDA graph (wall clock on the CPU; bench/lib/timing.py)."""
    return time_calls([fn], replays=iters, budget_s=float("inf"))[0] / 1e3


def fp8_matmuls(preset: str, device: torch.device, rows_list: list[int], iters: int) -> list[dict]:
    """The decoder matmuls of one step, bf16 against fp8 (module docstring), per row count."""
    cfg = preset_config(preset)
    h, i = cfg.hidden, cfg.intermediate
    shapes = [((cfg.q_heads + 2 * cfg.kv_heads) * cfg.head_dim, h), (h, cfg.q_heads * cfg.head_dim), (2 * i, h), (h, i)]
    gen = torch.Generator(device=device).manual_seed(0)
    layers = []
    for _ in range(cfg.num_layers):
        ws = [(torch.randn(n, k, generator=gen, device=device) / k**0.5).to(torch.bfloat16) for n, k in shapes]
        layers.append((ws, [Fp8Linear.from_weight(w) for w in ws]))
    flops = 2 * sum(n * k for n, k in shapes) * cfg.num_layers
    bf16_bytes = flops  # two FLOPs and two bytes per weight element
    out = []
    if device.type == "cuda":  # clocks up before the first timing
        a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 2.0:
            a @ a
        torch.cuda.synchronize()
        del a
    for rows in rows_list:
        xs = [torch.randn(rows, k, generator=gen, device=device).to(torch.bfloat16) for _, k in shapes]

        def bf16_step(xs=xs):
            for ws, _ in layers:
                for x, w in zip(xs, ws, strict=True):
                    gemv_module.linear(x, w)

        def fp8_step(xs=xs):
            for _, fs in layers:
                for x, f in zip(xs, fs, strict=True):
                    f(x)

        row = {"rows": rows, "bf16_ms": graph_ms(bf16_step, iters, device), "fp8_ms": graph_ms(fp8_step, iters, device)}
        limit = fp8_module.FP8_GEMV_MAX_ROWS
        if rows <= limit:
            fp8_module.FP8_GEMV_MAX_ROWS = 0
            row["fp8_scaled_mm_ms"] = graph_ms(fp8_step, iters, device)
        elif rows <= 128:  # the few-row e4m3 kernel past its limit, all rows in one tile
            fp8_module.FP8_GEMV_MAX_ROWS = rows
            row["fp8_triton_ms"] = graph_ms(fp8_step, iters, device)
        fp8_module.FP8_GEMV_MAX_ROWS = limit
        fp8_module.FAST_ACCUM = False
        row["fp8_exact_accum_ms"] = graph_ms(fp8_step, iters, device)
        fp8_module.FAST_ACCUM = True
        if fp8_module.TENSORWISE:  # every product with row-wise scales (no unscaled GEMM + apply_scales)
            rule, fp8_module.TENSORWISE = fp8_module.TENSORWISE, False
            row["fp8_rowwise_only_ms"] = graph_ms(fp8_step, iters, device)
            fp8_module.TENSORWISE = rule
        if rows <= max(gemv_module.GEMV_MAX_ROWS, fp8_module.FP8_GEMV_MAX_ROWS):
            limit, gemv_module.GEMV_MAX_ROWS = gemv_module.GEMV_MAX_ROWS, 0
            row["bf16_cublas_ms"] = graph_ms(bf16_step, iters, device)
            gemv_module.GEMV_MAX_ROWS = limit
        row["speedup"] = row["bf16_ms"] / row["fp8_ms"]
        row["bf16_tflops"] = flops * rows / (row["bf16_ms"] / 1e3) / 1e12
        row["fp8_tflops"] = flops * rows / (row["fp8_ms"] / 1e3) / 1e12
        row["bf16_weight_gbs"] = bf16_bytes / (row["bf16_ms"] / 1e3) / 1e9
        row["fp8_weight_gbs"] = bf16_bytes / 2 / (row["fp8_ms"] / 1e3) / 1e9
        out.append(row)
        print("  " + "  ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()),
              flush=True)  # fmt: skip
    return out


# ---- fused against unfused q/k/v and gate/up projections of a transformers Llama (--fusion-ab) ----------------------
FUSION_LLAMA_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                   "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
                   "rope_theta": 500000.0}  # fmt: skip
FUSION_TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 512}  # fmt: skip


def fusion_llama(config: dict, device: torch.device, fused: bool, quantization: str | None):
    """An `HFModel` of a random-weight transformers Llama of `config` (bf16 on CUDA, fp32 on the CPU), its
    projections in fp8 when `quantization`, q/k/v and gate/up fused when `fused`."""
    import transformers

    from batchkv.models.hf import HFModel, quantize_decoder

    cfg = transformers.LlamaConfig(**config, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        hf = transformers.LlamaForCausalLM._from_config(cfg, dtype=torch.bfloat16 if device.type == "cuda" else None)
    if quantization is not None:
        quantize_decoder(hf)
    return HFModel(hf.eval(), fuse=fused)


def fusion_step_ms(model, rows: int, iters: int) -> tuple[float, str]:
    """`step_ms`, and how it was timed ("graph" on CUDA unless the step could not be captured; "wall" on the CPU)."""
    dev = model.device
    ids = torch.randint(0, model.vocab_size, (rows,), device=dev)
    idx = torch.zeros(3, rows, dtype=torch.int64, device=dev)
    idx[0] = torch.arange(rows, device=dev) + 100
    sel = torch.arange(rows, device=dev)
    cache = NullAttention()
    us, how = time_calls([lambda: model(ids, idx, cache, sel)], replays=iters, budget_s=float("inf"))
    return us / 1e3, how


def fusion_ab(config: dict, device: torch.device, rows_list: list[int], iters: int) -> list[dict]:
    """Step ms of the unfused and the fused model, bf16 and fp8, at each row count (module docstring);
    one model at a time on the device, each row count timed unfused then fused."""
    out = {rows: {"rows": rows} for rows in rows_list}
    for quantization in (None, "fp8"):
        fmt = quantization or "bf16"
        for fused in (False, True):
            model = fusion_llama(config, device, fused, quantization)
            key = f"{fmt}_{'fused' if fused else 'unfused'}"
            for rows in rows_list:
                out[rows][f"{key}_ms"], out[rows][f"{key}_timed"] = fusion_step_ms(model, rows, iters)
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
        for row in out.values():
            row[f"{fmt}_saved_ms"] = row[f"{fmt}_unfused_ms"] - row[f"{fmt}_fused_ms"]
            row[f"{fmt}_speedup"] = row[f"{fmt}_unfused_ms"] / row[f"{fmt}_fused_ms"]
    for row in out.values():
        print("  " + "  ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()),
              flush=True)  # fmt: skip
    return list(out.values())


# ---- end of --fusion-ab ---------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="sensenova-u1-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--quantization", choices=["fp8"], default=None, help="e4m3 projections (batchkv.models.quant)")
    parser.add_argument("--fp8-matmuls", action="store_true", help="the decoder's matmuls alone, bf16 against fp8")
    parser.add_argument("--fusion-ab", action="store_true", help="a Llama-3.1-8B-shape HFModel step, q/k/v and "
                        "gate/up fused against unfused, bf16 and fp8")  # fmt: skip
    parser.add_argument("--fusion-small", action="store_true", help="--fusion-ab on a tiny Llama (CPU smoke run)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.fusion_ab:
        config = FUSION_TINY if args.fusion_small else FUSION_LLAMA_8B
        print(f"Llama step on {device} ({'tiny' if args.fusion_small else '8B shape'}), unfused against fused (ms)")
        with torch.inference_mode():
            steps = fusion_ab(config, device, args.rows, args.iters)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"model": "transformers LlamaConfig, random weights", "config": config, "device": str(device),
                           "command": "python bench/model_step.py " + " ".join(sys.argv[1:]),
                           "fusion_ab": steps}, f, indent=1)  # fmt: skip
        return
    if args.fp8_matmuls:
        print(f"{args.preset} decoder matmuls per step on {device}, bf16 against fp8 (ms)")
        with torch.inference_mode():
            steps = fp8_matmuls(args.preset, device, args.rows, args.iters)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"preset": args.preset, "device": str(device), "fp8_matmuls": steps}, f)
        return
    with torch.inference_mode():
        t0 = time.perf_counter()
        model = build_model(args.preset, device, quantization=args.quantization)
        built_s = time.perf_counter() - t0
        cfg = model.config
        tensors = [*model.named_parameters(), *model.named_buffers()]
        weight_bytes = sum(t.numel() * t.element_size() for name, t in tensors if name != "embed_tokens")
        peak = copy_ceiling(device)[0] if device.type == "cuda" else float("nan")
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
            if args.quantization == "fp8" and device.type == "cuda":  # the quantiser as a separate pass
                producers.FUSED_QUANT = False
                results[-1]["unfused_quant_ms"] = step_ms(model, rows, args.iters)
                producers.FUSED_QUANT = True
                print(f"  rows {rows:3d}: quantiser as a separate pass {results[-1]['unfused_quant_ms']:8.3f} ms/step")
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
