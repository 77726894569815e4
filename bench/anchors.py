"""TensorRT-LLM's published Llama-3.1-8B H200 workloads (`PUBLISHED`: tok/s, requests; `SOURCE`: trtllm-bench,
FP8, fixed lengths) served on the same shape (transformers `LlamaConfig`, random bf16 weights) through `HFModel`: all
requests at once, EOS ignored, greedy, `max_seqs="auto"`, graphs, overlap; bf16, fp8 (e4m3 projections,
per-token activations), fp8 + e4m3 K/V, one engine each, warmed once. Each run records output tokens/s, the
steady rate while requests waited and the workload's own limit (`workload_limit` at this run's rates).

    python3 bench/anchors.py --out bench/results/anchors-h200.json --budget-s 500     # on the H200
    python bench/anchors.py --small --out /tmp/a.json                                  # CPU smoke run

`--max-seqs N`: `Engine(max_seqs=N)` (results keyed `bf16@N`; `--resume` adds to a JSON). #38's 256
against 1,024 rows: `--workloads 128/512 --configs bf16 --requests bf16=4096 --max-seqs 256`, then 1024.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout: bench.lib and batchkv
from batchkv.executor import Engine, Request, SamplingParams
from bench.lib.ceilings import matmul_peak, read_ceiling
from bench.lib.roofline import LLAMA_8B, TINY_LLAMA, fp8_weights, shape_cost, workload_limit
from bench.lib.serving import freeze_heap, release, sync, workload
from bench.lib.timing import Deadline

SOURCE = (
    "TensorRT-LLM docs/source/performance/perf-overview.md, Llama 3.1 8B FP8, one H200 (trtllm-bench throughput, "
    "output tokens/s)"
)
PUBLISHED = {"128/128": (27911, 30000), "1000/1000": (17744, 3000), "2048/2048": (12194, 1500),
             "5000/500": (3902, 1500)}  # fmt: skip
KINDS = {"matmul": ("gemm", "gemv", "nvjet", "cutlass", "xmma"), "attention_split": ("split_kernel",),
         "attention_long": ("long_kernel",), "attention_other": ("attn", "merge", "sdpa"), "silu_mul": ("silu",),
         "quantise": ("quant", "amax"), "norm_rope": ("norm", "rope"), "kv_write": ("write", "scatter")}  # fmt: skip


def profiled(engine: Engine, steps: int) -> tuple[list, dict]:
    """`steps` engine steps under the torch profiler: their events, and ms per step of the GPU's kernels
    by kind (KINDS, by name; the rest "other"), busy in all, and of the wall clock, with the rows running."""
    from torch.profiler import ProfilerActivity, profile

    running, start = engine.num_running, time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        events = [event for _ in range(steps) for event in engine.step()]
        torch.cuda.synchronize()
    by = {"wall": (time.perf_counter() - start) * 1e3, "busy": 0.0} | dict.fromkeys([*KINDS, "other"], 0.0)
    for e in (e for e in prof.events() if e.device_type.name == "CUDA"):
        by[next((k for k, names in KINDS.items() if any(n in e.name.lower() for n in names)), "other")] += e.device_time
        by["busy"] += e.device_time
    return events, {"running": running} | {k: round(v / steps / (1 if k == "wall" else 1e3), 3) for k, v in by.items()}


def serve(engine: Engine, prompts, outputs, device: torch.device, profile_steps: int = 0, deadline=None) -> dict:
    """Every request at once, EOS ignored, greedy; whole-run and steady output tok/s; `profile_steps` steps profiled
    at half the output (`profiled`); past `deadline` the run stops where it is (`finished` False: what ran)."""
    engine.clear_prefix_cache()
    engine.metrics = engine.metrics.fresh()
    params = [SamplingParams(max_new_tokens=o, ignore_eos=True) for o in outputs]
    for p, sp in zip(prompts, params, strict=True):
        engine.submit(Request(p, sp))
    sync(device)
    start = time.perf_counter()
    times, tokens = [], 0  # times[j]: (seconds, tokens so far) when the j-th request finished
    profile = None
    while engine.has_work and (deadline is None or deadline.left() > 0):
        if profile is None and profile_steps and 2 * tokens >= sum(outputs):
            events, profile = profiled(engine, profile_steps)
        else:
            events = engine.step()
        for event in events:
            tokens += event.token is not None
            if event.finish_reason is not None:
                times.append((time.perf_counter() - start, tokens))
    wall = time.perf_counter() - start
    n, seqs = len(prompts), engine.cache.max_seqs
    waiting_until = n - seqs  # while fewer had finished, requests were still waiting for a column
    steady = None
    if 1 < waiting_until <= len(times):
        (t0, k0), (t1, k1) = times[0], times[waiting_until - 1]
        steady = (k1 - k0) / (t1 - t0) if t1 > t0 else None
    summary = engine.metrics.summary()
    done = not engine.has_work
    return {"requests": n, "finished": done, "tokens_per_s": tokens / wall, "steady_tokens_per_s": steady,
            "wall_s": wall, "output_tokens": tokens, "steps": summary.get("steps"), "profile_ms_per_step": profile,
            "ttft_p50_ms": summary.get("ttft_ms_p50"), "p50_itl_ms": summary.get("itl_ms_p50"),
            "steady_window": [times[0][0], times[waiting_until - 1][0]] if steady else None}  # fmt: skip


def build(config: dict, device: torch.device):
    """A transformers Llama of `config` with random bf16 weights (fp32 on the CPU), made on the device."""
    import transformers

    cfg = transformers.LlamaConfig(**config, attn_implementation="sdpa")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        hf = transformers.LlamaForCausalLM._from_config(cfg, dtype=dtype)
    return hf.eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench/results/anchors-h200.json"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="a tiny Llama and workloads: a smoke run")
    ap.add_argument("--budget-s", type=float, default=500.0, help="wall-clock budget; parts past it are skipped")
    ap.add_argument("--configs", default="bf16,fp8,fp8_e4m3", help="comma list of bf16, fp8, fp8_e4m3 (in order)")
    ap.add_argument("--workloads", default=",".join(PUBLISHED), help="comma list of ISL/OSL")
    ap.add_argument("--requests", default="fp8_e4m3=30000:3000:1500:1500,fp8=10000:1000:500:500,bf16=10000:1000:500:"
                    "500", help="per configuration, each workload's requests in --workloads order (default: the "
                    "published counts for fp8_e4m3, a third for the others)")  # fmt: skip
    ap.add_argument("--max-step-tokens", type=int, default=8192, help="the Engine's step budget (4,096 prompt tokens "
                    "beside the decoding rows; the Engine's own default is 1,024, for latency)")  # fmt: skip
    ap.add_argument("--profile-steps", type=int, default=0, help="steps profiled at half of each run's output")
    ap.add_argument("--resume", type=Path, default=None, help="a result JSON to add to")
    ap.add_argument("--max-seqs", default="auto", help="the Engine's max_seqs (auto, or a number: results keyed cfg@N)")
    args = ap.parse_args()
    max_seqs = args.max_seqs if args.max_seqs == "auto" else int(args.max_seqs)
    deadline = Deadline(args.budget_s)
    device = torch.device(args.device)
    config = TINY_LLAMA if args.small else LLAMA_8B
    names = ["16/8"] if args.small else [w for w in args.workloads.split(",") if w]
    parts = (part.partition("=") for part in args.requests.split(","))
    counts = {key: [int(v) for v in values.split(":")] for key, _, values in parts}
    result = json.loads(args.resume.read_text()) if args.resume else {}
    result.update(model="Llama-3.1-8B shape (transformers LlamaConfig, random weights)" if not args.small else
                  "tiny Llama (smoke)", device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                  torch=torch.__version__, config=config, source=SOURCE)  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        args.out.write_text(json.dumps(result, indent=1))

    if "read_gbps" not in result:
        result.update(read_gbps=read_ceiling(device)[0], bf16_tflops=matmul_peak(device)[0],
                      fp8_tflops=matmul_peak(device, fp8=True)[0])  # fmt: skip
    print(f"read {result['read_gbps']:.0f} GB/s, bf16 {result['bf16_tflops']:.0f} TFLOP/s, fp8 "
          f"{result['fp8_tflops']:.0f} TFLOP/s", flush=True)  # fmt: skip
    from batchkv.models.hf import HFModel, quantize_decoder

    hf = build(config, device)
    quantized = False
    works = result.setdefault("workloads", {})
    for name in names:
        entry = works.setdefault(name, {})
        if name in PUBLISHED:
            entry["published"] = dict(zip(("tokens_per_s", "requests"), PUBLISHED[name], strict=True), source=SOURCE)
    reach = max(sum(int(x) for x in name.split("/")) for name in names) + 1
    for cfg_name in [c for c in args.configs.split(",") if c]:
        if deadline.left() < 60:
            print(f"{cfg_name}: skipped, {deadline.left():.0f} s left", flush=True)
            continue
        if cfg_name != "bf16" and not quantized:
            quantize_decoder(hf)
            quantized = True
            release(device)
        elif cfg_name == "bf16" and quantized:
            raise SystemExit("bf16 must come before the fp8 configurations (the model is quantised in place)")
        kv_dtype = torch.float8_e4m3fn if cfg_name == "fp8_e4m3" else None
        model = HFModel(hf, kv_dtype=kv_dtype)
        key = cfg_name if max_seqs == "auto" else f"{cfg_name}@{max_seqs}"
        engine = Engine(model, max_seqs=max_seqs, kv_positions="auto", capacity=reach, use_graphs=device.type == "cuda",
                        device=device, max_step_tokens=args.max_step_tokens)  # fmt: skip
        warm_s = engine.warm_up()
        freeze_heap()  # until release(): no full collection walks the model in a timed step
        print(f"{key}: engine {engine.sizing.describe() if engine.sizing else ''}; warm-up {warm_s:.0f} s", flush=True)
        for j, name in enumerate(names):
            n = 4 if args.small else counts[cfg_name][j]
            if deadline.left() < 30:
                works[name][key] = {"status": f"skipped: {deadline.left():.0f} s of the budget left"}
                continue
            isl, osl = (int(x) for x in name.split("/"))
            prompts, outputs = workload(n, (isl, isl), (osl, osl), config["vocab_size"])
            got = serve(engine, prompts, outputs, device, args.profile_steps, deadline)  # what ran, if it ends
            cost = shape_cost(config, engine.cache.config.bytes_per_position())
            fp8 = cfg_name != "bf16"
            lim = workload_limit(prompts, outputs, fp8_weights(cost) if fp8 else cost, result["read_gbps"],
                                 result["bf16_tflops"], result["fp8_tflops"] if fp8 else None)  # fmt: skip
            lim["serial"] = lim.pop("no_overlap")
            got.update(limit_tokens_per_s=lim, max_seqs=engine.cache.max_seqs, warm_up_s=warm_s,
                       max_step_tokens=engine.scheduler.max_step_tokens, kv_dtype=str(engine.cache.config.kv_dtype),
                       store=engine.sizing.describe() if engine.sizing else None)  # fmt: skip
            works[name][key] = got
            save()
            print(f"{name} {key}: {got['tokens_per_s']:.0f} tok/s (steady {got['steady_tokens_per_s'] or 0:.0f}) "
                  f"from {n} requests; limit {lim['overlap']:.0f} / {lim['serial']:.0f}; published "
                  f"{PUBLISHED.get(name, (None,))[0]}", flush=True)  # fmt: skip
        engine.close()
        del engine, model
        release(device)
    save()


if __name__ == "__main__":
    main()
