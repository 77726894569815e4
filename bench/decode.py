"""End-to-end decode at SenseNova-U1-8B shape (random bf16 weights), offline and online, beside the
workload's limits measured in the same run, and one sequence against transformers.

Parts, in order, each under the run's budget (`--budget-s`), each written to the JSON when it ends:
1. ceilings: read bandwidth, copy bandwidth, bf16 GEMM peak (bench/lib/ceilings.py);
2. b1: one sequence, prompt 512, 256 new tokens, greedy, ms/token (median inter-token latency of
   a second, warmed-up request), batchkv with CUDA graphs and eager;
3. serve: 256 requests, prompts U[64, 2048], outputs U[64, 1024], seed 0, all at once, on the
   README's configuration (`max_seqs="auto"`): output tokens/s, TTFT and inter-token p50/p99, the
   workload's own limit from the request list and the fair roofline over the steps the engine ran
   (bench/lib/roofline.py); serve_e4m3 the same with e4m3 K/V; serve_fp8 and serve_fp8_e4m3 with
   FP8 compute (`quantization="fp8"`), K/V in bf16 and e4m3, the limit's projections at the FP8 rate;
4. online: three Poisson arrival rates (0.25, 0.5 and 0.9 of the offline run's requests/s), each
   over the first `rate * --online-window-s` requests, on the engine the offline run warmed
   (bench/lib/online.py): tokens/s, TTFT (from arrival) and inter-token p50/p99;
5. b1_hf_eager, b1_hf_static_compile: transformers' Qwen3ForCausalLM of the same shape, one sequence
   as in b1, eager with a DynamicCache and with a StaticCache and the forward compiled
   ("reduce-overhead": CUDA graphs inside torch.compile; CUDA only). Its serving peer, transformers'
   continuous batching, is in history (bench/results/README.md).
--resume FILE runs only the parts that FILE lacks (a part skipped for budget or failed runs again).

    python3 bench/decode.py --out bench/results/decode-h200.json                 # on the H200
    python bench/decode.py --small --out /tmp/d.json                             # CPU smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout: bench.lib and batchkv
from batchkv.executor import Engine
from batchkv.models import build_model, preset_config
from bench.lib.ceilings import copy_ceiling, matmul_peak, read_ceiling
from bench.lib.online import poisson_arrivals, run_online
from bench.lib.roofline import StepLog, fair_seconds, fp8_weights, model_cost, workload_limit
from bench.lib.serving import (
    WARM_UP,
    Parts,
    full_chunk_step_ms,
    one_sequence,
    release,
    serve_offline,
    serving_engine,
    sync,
    warm_up,
    workload,
)
from bench.lib.timing import Deadline

RATE_FRACTIONS = {"light": 0.25, "medium": 0.5, "near_saturation": 0.9}


def batchkv_parts(parts: Parts, ctx: SimpleNamespace, args) -> None:
    r, dev = parts.result, ctx.device

    def ceilings():
        r["read_gbps"], r["read_variants_gbps"] = read_ceiling(dev)
        r["copy_gbps"], r["copy_variants_gbps"] = copy_ceiling(dev)
        r["matmul_tflops"], r["matmul_variants_tflops"] = matmul_peak(dev)

    def b1():
        cost = ctx.cost()
        kv = cost.kv_bytes_per_pos * (ctx.prompt_len + ctx.new_tokens // 2)
        r["weight_bytes_per_step"] = cost.weight_bytes
        r["roofline_ms_b1"] = (cost.weight_bytes + kv) / (r["read_gbps"] * 1e9) * 1e3  # weights + mean KV, read
        # updated, not replaced: a --resume keeps the transformers single-sequence entries already there
        r.setdefault("b1", {}).update(prompt=ctx.prompt_len, new_tokens=ctx.new_tokens)
        r["b1_detail"] = {}
        for name, graphs in (("batchkv_graph", True), ("batchkv_eager", False)):
            if graphs and dev.type != "cuda":
                continue
            model = ctx.model()
            d = one_sequence(model, dev, ctx.prompt_len, ctx.new_tokens, model.vocab_size, graphs)
            r["b1_detail"][name] = {**d, "tokens": len(d["tokens"])}
            r["b1"][f"{name}_ms"] = d["ms_per_token_p50"]
            print(f"b1 {name}: {d['ms_per_token_p50']:.3f} ms/token", flush=True)

    def serve_entry(engine: Engine, d: dict, log: StepLog, warm_captures: int, fp8: bool) -> dict:
        # K/V bytes as the engine stores them (e4m3: one byte an element plus the scales), for every roofline
        cost = dataclasses.replace(ctx.cost(), kv_bytes_per_pos=engine.cache.config.bytes_per_position())
        body_tflops = None
        if fp8:  # the projections' FLOPs at the FP8 GEMM rate, their weights one byte: the limit only
            if "fp8_tflops" not in r:
                r["fp8_tflops"] = matmul_peak(dev, fp8=True)[0]
            cost, body_tflops = fp8_weights(cost), r["fp8_tflops"]
        fair_s = fair_seconds(log.steps, cost, r["read_gbps"], r["matmul_tflops"])
        limit = workload_limit(ctx.prompts, ctx.outputs, cost, r["read_gbps"], r["matmul_tflops"], body_tflops)
        return {
            "requests": len(ctx.prompts), "max_seqs": engine.cache.max_seqs,
            "tokens_per_s": d["output_tokens_per_s_wall"], "requests_per_s": len(ctx.prompts) / d["wall_s"],
            "kv_dtype": str(engine.cache.config.kv_dtype), **({"quantization": "fp8"} if fp8 else {}),
            "store": engine.sizing.describe() if engine.sizing else f"{engine.cache.max_seqs} columns at capacity",
            "store_bytes": engine.cache.nbytes, "decode_rows_per_step": d["decode_tokens"] / max(len(log.steps), 1),
            "workload_limit_tokens_per_s": {k: limit[k] for k in ("overlap", "no_overlap")}, "workload_limit": limit,
            **({} if fp8 else {"fair_roofline_tokens_per_s": d["generated_tokens"] / fair_s,
                               "fair_roofline_s": fair_s}),
            "p50_itl_ms": d["itl_ms_p50"], "p99_itl_ms": d["itl_ms_p99"], "ttft_p50_ms": d["ttft_ms_p50"],
            "ttft_p99_ms": d["ttft_ms_p99"], "captures": d["captures"] - warm_captures,
            "captures_warm_up": warm_captures, "steps": len(log.steps), "wall_s": d["wall_s"],
            "prefill_budget": engine.scheduler.prefill_budget, "overlap": engine.overlap, "warm_up": WARM_UP,
        }  # fmt: skip

    def run_serve(max_seqs, kv_dtype=None, fp8: bool = False) -> tuple[Engine, dict]:
        if fp8:
            ctx.cost()  # from the bf16 model, before the FP8 one takes its place
        model = ctx.fp8_model() if fp8 else ctx.model()
        engine = serving_engine(model, dev, ctx.prompts, ctx.outputs, max_seqs, kv_dtype)
        warm_up(engine, dev, ctx.prompts, ctx.outputs)
        warm_captures = engine.runner.captures
        log = StepLog(engine)
        d = serve_offline(engine, dev, ctx.prompts, ctx.outputs)
        return engine, {**serve_entry(engine, d, log, warm_captures, fp8), "detail": d}

    def serve():
        ctx.engine, entry = run_serve("auto")
        r["serve_detail"] = entry.pop("detail")
        r.setdefault("serve", {}).update(entry)  # (the peer's parts keep their entries here on a resumed run)
        r["serve"]["full_chunk_step_ms"] = full_chunk_step_ms(ctx.engine, dev, ctx.prompts)
        for row in r["serve"].get("online", []):  # rows of a resumed run: in this unit
            row["ttft_p50_in_full_chunk_steps"] = row["ttft_p50_ms"] / r["serve"]["full_chunk_step_ms"]
        print(f"serve: {entry['tokens_per_s']:.0f} tok/s (workload limit {entry['workload_limit_tokens_per_s']})")

    def other(key: str, max_seqs, kv_dtype=None, fp8: bool = False):
        def part():
            if ctx.engine is not None:  # its store holds the device: let it go first
                ctx.engine.close()
                ctx.engine = None
                release(dev)
            engine, entry = run_serve(max_seqs, kv_dtype, fp8)
            entry.pop("detail")
            r[key] = entry
            engine.close()
            release(dev)
            print(f"{key}: {entry['tokens_per_s']:.0f} tok/s", flush=True)

        return part

    def online():
        if ctx.engine is None:  # resumed without the offline run: warm a new engine on a short pass
            ctx.engine = serving_engine(ctx.model(), dev, ctx.prompts, ctx.outputs)
            warm_up(ctx.engine, dev, ctx.prompts, ctx.outputs)
        engine = ctx.engine
        base = r["serve"]["requests_per_s"]
        rows = r["serve"].setdefault("online", [])
        for i, (label, fraction) in enumerate(RATE_FRACTIONS.items()):
            if any(row["label"] == label for row in rows):
                continue
            rate = fraction * base
            n = int(min(len(ctx.prompts), max(4, round(rate * args.online_window_s))))
            arrivals = poisson_arrivals(n, rate, seed=i)
            row = {"label": label, "fraction_of_offline": fraction, "arrival_seed": i}
            row.update(run_online(engine, ctx.prompts[:n], ctx.outputs[:n], arrivals))
            row["arrival_rate"], row["rate"] = row["rate"], rate  # what arrived; the Poisson rate asked
            if r["serve"].get("full_chunk_step_ms"):
                row["ttft_p50_in_full_chunk_steps"] = row["ttft_p50_ms"] / r["serve"]["full_chunk_step_ms"]
            rows.append(row)
            parts.save()
            print(f"online {label} {rate:.2f} req/s: {row['tokens_per_s']:.0f} tok/s, TTFT p50 "
                  f"{row['ttft_p50_ms']:.0f} ms, ITL p50 {row['itl_p50_ms']:.1f} ms", flush=True)  # fmt: skip

    parts.run("ceilings", ceilings)
    parts.run("b1_batchkv", b1, need_s=20)
    parts.run("serve_batchkv", serve, need_s=60)
    parts.run("online_batchkv", online, need_s=3 * args.online_window_s + 20)
    parts.run("serve_e4m3_batchkv", other("serve_e4m3", "auto", torch.float8_e4m3fn), need_s=40)

    parts.run("serve_fp8_batchkv", other("serve_fp8", "auto", fp8=True), need_s=40)
    parts.run("serve_fp8_e4m3_batchkv", other("serve_fp8_e4m3", "auto", torch.float8_e4m3fn, fp8=True), need_s=40)


def qwen3_like(device: torch.device, dtype: torch.dtype = torch.bfloat16, tiny: bool = False, seed: int = 0):
    """A randomly initialised Qwen3ForCausalLM with SenseNova-U1-8B's language-model shape (or, tiny,
    the shape of the `sensenova-u1-tiny` preset, for smoke runs on CPU)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    shape = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32) if tiny else dict(
                 vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=42,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=128)  # fmt: skip
    config = Qwen3Config(**shape, rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=32768,
                         attention_bias=False)  # fmt: skip
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(dtype)
    return model.eval()


@torch.inference_mode()
def decode_ms_per_token(model, prompt_len: int, new_tokens: int, static_compile: bool = False) -> float:
    """Greedy decode of one sequence after a prompt; milliseconds per generated token (decode only).

    static_compile: a `StaticCache` and `torch.compile(mode="reduce-overhead", fullgraph=True)` on the
    forward, warmed up over a full run first so compilation and graph recording are not timed.
    """
    from transformers import DynamicCache, StaticCache

    device = next(model.parameters()).device
    params = inspect.signature(model.forward).parameters
    name = "cache" if "cache" in params and "past_key_values" not in params else "past_key_values"
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, prompt_len), generator=gen).to(device)
    static = StaticCache(config=model.config, max_cache_len=prompt_len + new_tokens + 8) if static_compile else None
    forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True) if static_compile else model.forward

    def run(steps: int) -> float:
        if static is not None:
            static.reset()
        cache = static if static is not None else DynamicCache()
        pos = torch.arange(prompt_len, device=device)
        out = model(input_ids=ids, position_ids=pos[None], cache_position=pos, use_cache=True, **{name: cache})
        token = out.logits[:, -1:].argmax(-1)
        sync(device)
        start = time.perf_counter()
        for step in range(steps):
            p = torch.full((1,), prompt_len + step, device=device)
            out = forward(input_ids=token, position_ids=p[None], cache_position=p, use_cache=True, **{name: cache})
            token = out.logits[:, -1:].argmax(-1)
        sync(device)
        return (time.perf_counter() - start) * 1e3 / steps

    run(16)  # warm-up: cuBLAS handles, and for the compiled path compilation and graph recording
    return run(new_tokens)


def hf_parts(parts, ctx: SimpleNamespace) -> None:
    """`b1_hf_eager` and (on CUDA) `b1_hf_static_compile` into the result's `b1`."""
    r, dev = parts.result, ctx.device
    model = qwen3_like(dev, tiny=ctx.small)

    def single(static: bool):
        key = "hf_static_compile_ms" if static else "hf_eager_ms"
        b1 = r.setdefault("b1", {"prompt": ctx.prompt_len, "new_tokens": ctx.new_tokens})
        b1[key] = decode_ms_per_token(model, ctx.prompt_len, ctx.new_tokens, static_compile=static)
        print(f"b1 {key}: {b1[key]:.3f} ms/token", flush=True)

    parts.run("b1_hf_eager", lambda: single(False), need_s=40)
    if dev.type == "cuda":  # on CPU inductor's C++ compile of the model takes minutes: not a smoke test
        parts.run("b1_hf_static_compile", lambda: single(True), need_s=150)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("bench/results/decode-h200.json"))
    ap.add_argument("--preset", default=None, help="batchkv model preset (default sensenova-u1-8b, tiny with --small)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="tiny model and workload: a smoke run")
    ap.add_argument("--skip-hf", action="store_true", help="no transformers parts")
    ap.add_argument("--serve-requests", type=int, default=256)
    ap.add_argument("--budget-s", type=float, default=390.0, help="wall-clock budget of the whole run")
    ap.add_argument("--online-window-s", type=float, default=None, help="seconds of arrivals per rate (12; 3 small)")
    ap.add_argument("--resume", type=Path, default=None, help="a result JSON to complete: only missing parts run")
    ap.add_argument("--skip-parts", default="", help="comma-separated parts not to run (e.g. online_batchkv)")
    args = ap.parse_args()
    if args.online_window_s is None:
        args.online_window_s = 3.0 if args.small else 12.0
    deadline = Deadline(args.budget_s)
    device = torch.device(args.device)
    preset = args.preset or ("sensenova-u1-tiny" if args.small else "sensenova-u1-8b")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = json.loads(args.resume.read_text()) if args.resume else {}
    result.update(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", torch=torch.__version__,
                  preset=preset, budget_s=args.budget_s)  # fmt: skip
    n = 8 if args.small else args.serve_requests
    ranges = ((8, 64), (4, 32)) if args.small else ((64, 2048), (64, 1024))
    prompts, outputs = workload(n, *ranges, preset_config(preset).vocab)
    model = functools.cache(lambda: build_model(preset, device, seed=0))

    @functools.cache
    def fp8_model():
        model.cache_clear()  # the bf16 model's memory goes to the store
        release(device)
        return build_model(preset, device, seed=0, quantization="fp8")

    cost = functools.cache(lambda: model_cost(model(), preset_config(preset).q_heads))
    ctx = SimpleNamespace(device=device, prompts=prompts, outputs=outputs, engine=None, small=args.small,
                          prompt_len=32 if args.small else 512, new_tokens=16 if args.small else 256, model=model,
                          fp8_model=fp8_model, cost=cost)  # fmt: skip
    parts = Parts(result, args.out, deadline)
    parts.skip = tuple(filter(None, args.skip_parts.split(",")))
    batchkv_parts(parts, ctx, args)
    if not args.skip_hf:
        if ctx.engine is not None:  # the peer gets the memory of batchkv's serving cache
            ctx.engine.close()
            ctx.engine = None
        model.cache_clear()
        fp8_model.cache_clear()
        release(device)
        hf_parts(parts, ctx)
    parts.save()


if __name__ == "__main__":
    main()
