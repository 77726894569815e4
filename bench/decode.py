"""End-to-end decode at SenseNova-U1-8B shape: batchkv (graphs / eager) against transformers, and the
weight-read roofline measured in the same run.

1. Single sequence: prompt 512, 256 new tokens, greedy; ms/token (median inter-token latency of a
   second, warmed-up request) for batchkv with CUDA graphs and eager; a transformers
   Qwen3ForCausalLM of the same shape, eager with DynamicCache and StaticCache +
   torch.compile(mode="reduce-overhead"). Roofline: bytes of weights (and KV) one step reads over
   the device-to-device copy bandwidth measured here.
2. Serving: 256 requests, prompts U[64, 2048], outputs U[64, 1024], seed 0, up to 64 sequences:
   output tokens/s, p50/p99 inter-token latency, captures; transformers eager `generate` over
   left-padded batches of 64 (--hf-serve-requests of them, default one batch: the rate of the
   same distribution); and the roofline tokens/s: an ideal machine decoding 64 sequences at a
   time reads the weights once per step and each token's own KV prefix once.

Writes JSON as it goes (--out), so a crash keeps the finished parts. Run on the H200:
    python3 bench/decode.py --out bench/results/decode-h200.json
Smoke test on CPU: python bench/decode.py --preset sensenova-u1-tiny --small --skip-hf --out /tmp/d.json
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batchkv.executor import Engine, Request, SamplingParams
from batchkv.models import build_model, preset_config


def copy_gbps(device: torch.device, nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth, bytes read + written per second / 1e9 (median of 20)."""
    if device.type != "cuda":
        return float("nan")
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(25):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * nbytes / float(np.median(times[5:])) / 1e9


def weight_bytes_per_step(model) -> int:
    """Bytes of parameters one decode step reads: everything but the embedding table (one row)."""
    return sum(p.numel() * p.element_size() for name, p in model.named_parameters() if "embed" not in name)


def kv_bytes_per_position(model) -> int:
    spec = model.cache_spec()
    return 2 * spec["num_layers"] * spec["kv_heads"] * spec["head_dim"] * torch.finfo(spec["dtype"]).bits // 8


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def single_sequence(model, device, prompt_len: int, new_tokens: int, graphs: bool) -> dict:
    """ms/token of one greedy sequence: the second of two identical requests (the first warms up)."""
    engine = Engine(
        model,
        max_seqs=1,
        capacity=prompt_len + new_tokens + 1,
        max_step_tokens=prompt_len,
        prefill_chunk=prompt_len,
        width_buckets=(1, prompt_len),
        use_graphs=graphs,
        device=device,
    )
    engine.cache.reserve(prompt_len + new_tokens + 1)
    gen = np.random.default_rng(0)
    prompt = gen.integers(0, model.vocab_size, prompt_len).tolist()
    params = SamplingParams(max_new_tokens=new_tokens)
    for _ in range(2):
        engine.metrics.inter_token.clear()
        engine.submit(Request(prompt, params))
        sync(device)
        start = time.perf_counter()
        events = engine.run_until_done()
        sync(device)
        wall = time.perf_counter() - start
    itl = np.asarray(engine.metrics.inter_token) * 1e3
    return {
        "ms_per_token_p50": float(np.median(itl)),
        "ms_per_token_mean": float(itl.mean()),
        "wall_s": wall,
        "tokens": sum(e.token is not None for e in events),
        "captures": engine.metrics.captures,
    }


def serve_workload(n: int, prompt: tuple[int, int], output: tuple[int, int], vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, vocab, rng.integers(prompt[0], prompt[1] + 1)).tolist() for _ in range(n)]
    outputs = rng.integers(output[0], output[1] + 1, n).tolist()
    return prompts, outputs


def serve(model, device, prompts, outputs, max_seqs: int, chunk: int, budget: int, graphs: bool) -> dict:
    capacity = max(map(len, prompts)) + max(outputs) + 1
    engine = Engine(
        model,
        max_seqs=max_seqs,
        capacity=capacity,
        max_step_tokens=budget,
        prefill_chunk=min(chunk, capacity),
        use_graphs=graphs,
        device=device,
    )
    engine.cache.reserve(capacity)  # serving reserves up front: no growth (and recapture) mid-run
    for p, o in zip(prompts, outputs, strict=True):
        engine.submit(Request(p, SamplingParams(max_new_tokens=o)))
    sync(device)
    start = time.perf_counter()
    engine.run_until_done()
    sync(device)
    wall = time.perf_counter() - start
    summary = engine.metrics.summary()
    summary["wall_s"] = wall
    summary["output_tokens_per_s_wall"] = summary["generated_tokens"] / wall
    return summary


def roofline_tokens_per_s(prompts, outputs, weight_bytes: int, kv_per_pos: int, gbps: float, batch: int) -> float:
    """Output tokens/s of an ideal machine: weights once per step of `batch` tokens, each token's KV once."""
    tokens = sum(outputs)
    kv = sum(kv_per_pos * (len(p) * o + o * (o + 1) // 2) for p, o in zip(prompts, outputs, strict=True))
    seconds = (tokens / batch * weight_bytes + kv) / (gbps * 1e9)
    return tokens / seconds


def batchkv_parts(result: dict, preset: str, device, prompt_len: int, new_tokens: int, prompts, outputs, save) -> None:
    """batchkv's single-sequence (graphs and eager) and serving numbers, and the rooflines."""
    graphs = device.type == "cuda"
    result["copy_gbps"] = gbps = copy_gbps(device)
    model = build_model(preset, device, seed=0)
    wbytes, kvpos = weight_bytes_per_step(model), kv_bytes_per_position(model)
    kv_b1 = kvpos * (prompt_len + new_tokens // 2)
    result["weight_bytes_per_step"] = wbytes
    result["roofline_ms_b1"] = (wbytes + kv_b1) / (gbps * 1e9) * 1e3
    result["b1"] = b1 = {"prompt": prompt_len, "new_tokens": new_tokens}
    b1_detail = {}
    for name, use in (("batchkv_graph", True), ("batchkv_eager", False)):
        if use and not graphs:
            continue
        b1_detail[name] = single_sequence(model, device, prompt_len, new_tokens, use)
        b1[f"{name}_ms"] = b1_detail[name]["ms_per_token_p50"]
        print(f"b1 {name}: {b1[f'{name}_ms']:.3f} ms/token", flush=True)
        save()
    result["b1_detail"] = b1_detail
    result["serve"] = s = {"requests": len(prompts), "max_seqs": 64}
    detail = serve(model, device, prompts, outputs, 64, chunk=512, budget=1024, graphs=graphs)
    s.update(
        tokens_per_s=detail["output_tokens_per_s_wall"],
        roofline_tokens_per_s=roofline_tokens_per_s(prompts, outputs, wbytes, kvpos, gbps, 64),
        p50_itl_ms=detail["itl_ms_p50"],
        p99_itl_ms=detail["itl_ms_p99"],
        captures=detail["captures"],
        width_buckets_used=detail["width_buckets_used"],
        growths=detail["growths"],
    )
    result["serve_detail"] = detail
    print(f"serve: {s['tokens_per_s']:.0f} tok/s (roofline {s['roofline_tokens_per_s']:.0f})", flush=True)
    save()
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/decode-h200.json")
    ap.add_argument("--preset", default="sensenova-u1-8b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="tiny sizes for a smoke test")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-compile", action="store_true", help="skip transformers StaticCache + compile")
    ap.add_argument("--serve-requests", type=int, default=256)
    ap.add_argument("--hf-serve-requests", type=int, default=64)
    ap.add_argument("--hf-serve-max-new", type=int, default=0, help="cap transformers' outputs (0: as drawn)")
    ap.add_argument("--resume", type=Path, default=None, help="a result JSON to complete: run only the missing parts")
    args = ap.parse_args()
    device = torch.device(args.device)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result: dict = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
    }

    def save() -> None:
        out.write_text(json.dumps(result, indent=2) + "\n")

    if args.resume is not None:  # finish a run that stopped early: only the parts it lacks
        result = json.loads(args.resume.read_text())
    prompt_len, new_tokens = (32, 16) if args.small else (512, 256)
    n = 8 if args.small else args.serve_requests
    prompt_range, output_range = ((8, 64), (4, 32)) if args.small else ((64, 2048), (64, 1024))
    prompts, outputs = serve_workload(n, prompt_range, output_range, preset_config(args.preset).vocab)
    if "serve" not in result:
        batchkv_parts(result, args.preset, device, prompt_len, new_tokens, prompts, outputs, save)
    b1, s = result["b1"], result["serve"]
    if args.skip_hf or device.type != "cuda":
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from hf_baselines import decode_ms_per_token, generate_padded, qwen3_like

    hf = qwen3_like(device)
    for key, static in (("hf_eager_ms", False), ("hf_static_compile_ms", True)):
        if (static and args.skip_compile) or b1.get(key) is not None:
            continue
        try:
            b1[key] = decode_ms_per_token(hf, prompt_len, new_tokens, static_compile=static)
            print(f"b1 {key}: {b1[key]:.3f} ms/token", flush=True)
        except Exception as exc:  # a peer that fails is recorded, not fatal
            b1[key] = None
            result.setdefault("errors", {})[key] = repr(exc)[:500]
        save()
    k = args.hf_serve_requests
    try:
        capped = [min(o, args.hf_serve_max_new or o) for o in outputs[:k]]
        hf_serve = generate_padded(hf, prompts[:k], capped, batch=64)
        s["hf_eager_outputs_capped_at"] = args.hf_serve_max_new or None
        s["hf_eager_tokens_per_s"] = hf_serve["tokens_per_s"]
        s["hf_eager_requests_measured"] = hf_serve["requests"]
        print(f"serve hf eager: {s['hf_eager_tokens_per_s']:.0f} tok/s over {k} requests", flush=True)
    except Exception as exc:
        s["hf_eager_tokens_per_s"] = None
        result.setdefault("errors", {})["hf_serve"] = repr(exc)[:500]
    save()


if __name__ == "__main__":
    main()
