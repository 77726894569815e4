"""Model-only decode step time against the weight-read roofline.

Runs `model(input_ids, indexes, cache, logits_rows)` for W = R rows (one decode token per sequence) with a
stand-in cache whose attention returns q, so the number is the model's own cost: every weight matrix read once,
plus the small kernels around them. On CUDA each width is captured in a CUDA graph and replayed; the roofline is
the weight bytes of one step over the measured device-to-device copy bandwidth (bench/lib/ceilings.py). Each width
is also timed with every matmul on cuBLAS (below GEMV_MAX_ROWS the model runs batchkv.models.gemv's few-row
kernel); `kernels` counts the kernels one eager step launches (= the nodes of its graph), from the profiler.
    python bench/model_step.py --preset sensenova-u1-8b --rows 1 8 32 64          # on the GPU
    python bench/model_step.py --preset sensenova-u1-tiny --device cpu --iters 3   # smoke test

`--quantization fp8` times the model with e4m3 projections (`batchkv.models.quant`) and, on CUDA, with the
activation quantiser as a separate pass (`unfused_quant_ms`).

`--fusion-ab` times the step of a random-weight transformers Llama of the Llama-3.1-8B shape through `HFModel`
(attention stood in for as above, logits of every row) with q/k/v and gate/up as the model has them against fused
(`batchkv.models.hf_fuse`), in bf16 and in fp8, at each of `--rows`; `--fusion-small`: a tiny Llama (CPU smoke).
`--fusion-arms`: `unfused` (fuse=False), `fused` (all but `hf_layers`' residual adds and FP8 codes in the norms),
`layers` (all; in fp8 also with the layers quantising for themselves, `noquant`). Each is timed by default.
    python bench/model_step.py --fusion-ab --rows 1 64 256 1024 --json out.json          # on the GPU

`--hf-kernels` (CUDA): kernels launched and GPU time per decode step of a random-weight Llama of SmolLM2-135M's
shape (bf16, tied head) served by an `Engine` with CUDA graphs, transformers' RMSNorm modules and RoPE as they are
against one kernel each (`batchkv.models.hf_norms`, `hf_rope`): `--rows` requests of a 64-token prompt, decoded
until each has its first token, then `--iters` steps timed (wall clock) and as many profiled (the kernels inside
the replays: count, summed time and the names that take the most). Also the norm and RoPE kernels against
transformers' op sequences at the served shapes (max |difference|), and how often the first requests' greedy
tokens agree between the two runs (random weights have near-ties: a rate, not a check). `--quantization fp8` adds
a run with e4m3 projections.
    python3 bench/model_step.py --hf-kernels --rows 256 --iters 20 --json $OUT/hf-step-kernels.json
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout: bench.lib and batchkv
import batchkv.models.gemv as gemv_module
import batchkv.models.quant.producers as producers
from batchkv.models import build_model
from bench.lib.ceilings import copy_ceiling
from bench.lib.roofline import LLAMA_8B, TINY_LLAMA
from bench.lib.timing import time_calls


class NullAttention:
    """Stands in for the cache: attention returns q (capturable, no KV traffic)."""

    def update_and_attend(self, layer, q, k, v, scale=None, causal=True):
        return q


def step_call(model, rows: int):
    """One decoder step of `rows` rows (attention left out) as a call."""
    dev = model.device
    ids = torch.randint(0, model.vocab_size, (rows,), device=dev)
    idx = torch.zeros(3, rows, dtype=torch.int64, device=dev)
    idx[0] = torch.arange(rows, device=dev) + 100
    sel, cache = torch.arange(rows, device=dev), NullAttention()
    return lambda: model(ids, idx, cache, sel)


def timed_ms(fn, iters: int) -> tuple[float, str]:
    """ms of `fn()`, the median of `iters` replays of one CUDA graph (wall clock on the CPU; bench/lib/timing.py),
    and how it was timed."""
    us, how = time_calls([fn], replays=iters, budget_s=float("inf"))
    return us / 1e3, how


def cuda_events(run, copies: bool = True) -> list:
    """The CUDA kernels (and with `copies` memcpy/memset) `run()` launches, from the profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    skip = () if copies else ("Memcpy", "Memset")
    return [e for e in prof.events() if e.device_type.name == "CUDA" and not (skip and e.name.startswith(skip))]


def kernels_per_step(model, rows: int) -> int:
    """Kernels one eager step launches (each is a node of the captured graph)."""
    step = step_call(model, rows)
    step()
    torch.cuda.synchronize()
    return len(cuda_events(step))


def show(row: dict) -> None:
    print("  " + "  ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)


# ---- transformers Llamas through HFModel (--fusion-ab, --hf-kernels) ----------------------------------------------
SMOLLM2 = {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
           "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "max_position_embeddings": 8192,
           "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": True}  # fmt: skip


def hf_llama(config: dict, device: torch.device, fuse: bool = True, fp8: bool = False, kernels: bool = True,
             layers: bool = True):  # fmt: skip
    """An `HFModel` of a random-weight transformers Llama of `config` (seed 0, norm weights 1 + 0.2 N(0, 1); bf16 on
    CUDA, fp32 on the CPU): projections in fp8 when `fp8`, `HFModel(fuse=)` (q/k/v, gate/up, norms and RoPE), the
    norms and RoPE as transformers has them unless `kernels` (`hf_norms.FUSE`, `hf_rope.FUSE`), the layers unless
    `layers` (`hf_layers.FUSE`)."""
    import transformers

    from batchkv.models import hf_layers, hf_norms, hf_rope
    from batchkv.models.hf import HFModel, quantize_decoder

    cfg = transformers.LlamaConfig(**config, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        hf = transformers.LlamaForCausalLM._from_config(cfg, dtype=torch.bfloat16 if device.type == "cuda" else None)
    with torch.no_grad():
        for p in hf.parameters():  # the default init's norm weights are all 1: make them differ
            if p.dim() == 1:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    if fp8:
        quantize_decoder(hf)
    hf_norms.FUSE = hf_rope.FUSE = kernels
    hf_layers.FUSE = layers
    try:
        return HFModel(hf.eval(), fuse=fuse)
    finally:
        hf_norms.FUSE = hf_rope.FUSE = hf_layers.FUSE = True


FUSION_ARMS = {"unfused": (False, False), "fused": (True, False), "layers": (True, True)}  # fuse=, hf_layers.FUSE


def fusion_ab(config: dict, device: torch.device, rows_list: list[int], iters: int, arms=tuple(FUSION_ARMS)) -> list:
    """Step ms of each arm (FUSION_ARMS; fp8 "layers" also with `hf_norms.QUANT` off), bf16 and fp8, at each row
    count (module docstring); one model at a time on the device, each row count timed arm after arm."""
    from batchkv.models import hf_norms

    out = {rows: {"rows": rows} for rows in rows_list}
    for fmt in ("bf16", "fp8"):
        for arm in arms:
            model = hf_llama(config, device, FUSION_ARMS[arm][0], fmt == "fp8", layers=FUSION_ARMS[arm][1])
            for rows in rows_list:
                out[rows][f"{fmt}_{arm}_ms"], out[rows][f"{fmt}_{arm}_timed"] = timed_ms(step_call(model, rows), iters)
                if fmt == "fp8" and arm == "layers":  # the residual adds alone
                    hf_norms.QUANT = False
                    out[rows]["fp8_layers_noquant_ms"] = timed_ms(step_call(model, rows), iters)[0]
                    hf_norms.QUANT = None
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
        for row in out.values():
            for base, new, name in (("unfused", "fused", ""), ("fused", "layers", "layers_")):
                if base in arms and new in arms:
                    row[f"{fmt}_{name}saved_ms"] = row[f"{fmt}_{base}_ms"] - row[f"{fmt}_{new}_ms"]
                    row[f"{fmt}_{name}speedup"] = row[f"{fmt}_{base}_ms"] / row[f"{fmt}_{new}_ms"]
    for row in out.values():
        show(row)
    return list(out.values())


def hf_served(label: str, kernels: bool, fp8: bool, rows: int, steps: int, prompt: int = 64) -> dict:
    """SmolLM2's shape served by an `Engine` with graphs: `rows` requests of `prompt` tokens, decoded until each has
    its first token, `steps` warm steps, `steps` timed and `steps` profiled (module docstring)."""
    from batchkv.executor import Engine, Request, SamplingParams
    from batchkv.models import hf_norms

    model = hf_llama(SMOLLM2, torch.device("cuda"), fp8=fp8, kernels=kernels)
    engine = Engine(model, max_seqs=rows, capacity=prompt + 128 + 4 * steps, use_graphs=True)
    params = SamplingParams(max_new_tokens=64 + 4 * steps, ignore_eos=True)
    ids = [engine.submit(Request([(i * 131 + j * 7) % 49000 + 10 for j in range(prompt)], params)) for i in range(rows)]
    tokens: dict[int, list[int]] = {i: [] for i in ids[:8]}
    started: set[int] = set()

    def step() -> int:
        events = engine.step()
        for e in events:
            if e.token is not None:
                started.add(e.request_id)
                tokens.get(e.request_id, []).append(e.token)
        return len(events)

    for _ in range(400):  # admission and prefill (bounded): until every request has its first token
        step()
        if len(started) == rows:
            break
    for _ in range(steps):  # warm: every width this run takes captured
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    decoded = sum(step() for _ in range(steps))
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - start) / steps * 1e3
    by_name: dict[str, list[float]] = collections.defaultdict(list)
    for e in cuda_events(lambda: [step() for _ in range(steps)], copies=False):
        by_name[e.name].append(e.time_range.elapsed_us())
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:12]
    modules = list(model.hf.modules())
    out = {"label": label, "norm_modules_swapped": sum(isinstance(m, hf_norms.FusedRMSNorm) for m in modules),
           "attention_modules_with_fused_rope": sum("forward" in m.__dict__ for m in modules),
           "running": engine.num_running, "tokens_per_step": decoded / steps, "wall_ms_per_step": round(wall_ms, 3),
           "kernels_per_step": round(sum(map(len, by_name.values())) / steps, 1),
           "gpu_kernel_ms_per_step": round(sum(sum(v) for v in by_name.values()) / steps / 1e3, 3),
           "top_kernels": [{"name": name[:90], "per_step": round(len(v) / steps, 1),
                            "ms_per_step": round(sum(v) / steps / 1e3, 4)} for name, v in top],
           "first_tokens": {str(i): t[:16] for i, t in tokens.items()}}  # fmt: skip
    engine.close()
    return out


def kernel_error() -> dict:
    """The norm and RoPE kernels against transformers' op sequences on the device at the served
    shapes (bf16): max |difference| and how many elements differ."""
    from batchkv.models import fused

    g, out = torch.Generator(device="cuda").manual_seed(0), {}

    def rand(*shape):
        return torch.randn(shape, generator=g, device="cuda").to(torch.bfloat16)

    def record(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        diff = (got.float() - want.float()).abs()
        out[name] = {"max_abs": diff.max().item(), "differ": int((diff > 0).sum()), "of": diff.numel()}

    for name, shape in (("hidden_256x576", (1, 256, 576)), ("head_256x9x64", (1, 256, 9, 64))):
        x, w = rand(*shape) * 3, (1 + 0.2 * torch.randn(shape[-1], generator=g, device="cuda")).to(torch.bfloat16)
        for form, (offset, first) in {"llama": (0.0, True), "gemma": (1.0, False)}.items():
            got = fused.rms_norm(x, w, 1e-5, offset=offset, round_first=first)
            record(f"norm_{name}_{form}", got, fused.rms_norm_torch(x, w, 1e-5, offset, first))
    q, k = rand(1, 256, 9, 64).transpose(1, 2), rand(1, 256, 3, 64).transpose(1, 2)
    angle = torch.rand(1, 256, 64, generator=g, device="cuda") * 6.3
    cos, sin = angle.cos().to(torch.bfloat16), angle.sin().to(torch.bfloat16)
    for part, got, want in zip("qk", fused.rope_qk(q, k, cos, sin), fused.rope_qk_torch(q, k, cos, sin), strict=True):
        record(f"rope_{part}_256x64", got, want)
    return out


def hf_kernels(rows: int, steps: int, fp8: bool) -> dict:
    """`kernel_error`, then the served runs with transformers' norms and RoPE and with the kernels (and with fp8)."""
    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    try:
        result["kernel_error"] = kernel_error()
    except Exception as exc:  # a probe: the step runs still report
        result["kernel_error"] = {"error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(result["kernel_error"]), flush=True)
    result["runs"] = []
    runs = [("transformers_ops", False, False), ("fused_norms_rope", True, False), ("fused_norms_rope_fp8", True, True)]
    for label, kernels, quantized in runs[: 2 + fp8]:
        try:
            r = hf_served(label, kernels, quantized, rows, steps)
        except Exception as exc:  # a probe: one run failing still reports the others
            r = {"label": label, "error": f"{type(exc).__name__}: {exc}", "first_tokens": {}}
        gc.collect()  # the run's engine and model gone before the next
        torch.cuda.empty_cache()
        result["runs"].append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "first_tokens"}), flush=True)
    a, b = (r["first_tokens"] for r in result["runs"][:2])
    pairs = [(x, y) for k in a for x, y in zip(a[k], b.get(k, []), strict=False)]
    result["greedy_agreement_fused_vs_not"] = sum(x == y for x, y in pairs) / max(1, len(pairs))
    print("greedy agreement (first 8 requests):", result["greedy_agreement_fused_vs_not"])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="sensenova-u1-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--iters", type=int, default=50, help="replays per timing (--hf-kernels: steps)")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--quantization", choices=["fp8"], default=None, help="e4m3 projections (batchkv.models.quant)")
    parser.add_argument("--fusion-ab", action="store_true", help="a Llama-3.1-8B-shape HFModel step, q/k/v and "
                        "gate/up fused against unfused, bf16 and fp8")  # fmt: skip
    parser.add_argument("--fusion-small", action="store_true", help="--fusion-ab on a tiny Llama (CPU smoke run)")
    parser.add_argument("--fusion-arms", nargs="+", choices=list(FUSION_ARMS), default=list(FUSION_ARMS),
                        help="--fusion-ab's arms: fuse=False; fused without the layers' fusions; all")  # fmt: skip
    parser.add_argument("--hf-kernels", action="store_true", help="kernels and GPU time per served step of a "
                        "SmolLM2-shape Llama, transformers' norms and RoPE against one kernel each")  # fmt: skip
    args = parser.parse_args()
    device = torch.device(args.device)
    command = "python bench/model_step.py " + " ".join(sys.argv[1:])
    if args.hf_kernels and len(args.rows) != 1:
        parser.error("--hf-kernels takes one --rows")
    with torch.inference_mode(not args.hf_kernels):  # --hf-kernels: an Engine's steps, as served
        if args.hf_kernels:
            report = hf_kernels(args.rows[0], args.iters, args.quantization == "fp8")
        elif args.fusion_ab:
            config = TINY_LLAMA if args.fusion_small else LLAMA_8B
            print(f"Llama step on {device} ({'tiny' if args.fusion_small else '8B shape'}), unfused against fused (ms)")
            report = {"model": "transformers LlamaConfig, random weights", "config": config, "device": str(device),
                      "command": command, "fusion_ab": fusion_ab(config, device, args.rows, args.iters,
                                                                  tuple(args.fusion_arms))}  # fmt: skip
        else:
            report = preset_steps(args, device)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


def preset_steps(args, device: torch.device) -> dict:
    """The preset's step at each of `--rows` against the roofline (module docstring)."""
    t0 = time.perf_counter()
    model = build_model(args.preset, device, quantization=args.quantization)
    built_s = time.perf_counter() - t0
    tensors = [*model.named_parameters(), *model.named_buffers()]
    weight_bytes = sum(t.numel() * t.element_size() for name, t in tensors if name != "embed_tokens")
    peak = copy_ceiling(device)[0] if device.type == "cuda" else float("nan")
    print(f"{args.preset} on {device}: {model.config.num_params / 1e9:.2f} B params, {weight_bytes / 1e9:.2f} GB read "
          f"per step, built in {built_s:.1f} s, copy peak {peak:.0f} GB/s")  # fmt: skip
    results = []
    for rows in args.rows:
        ms = timed_ms(step_call(model, rows), args.iters)[0]
        gbs, roof_ms = weight_bytes / (ms / 1e3) / 1e9, weight_bytes / (peak * 1e9) * 1e3
        row = {"rows": rows, "ms": ms, "weight_gbs": gbs, "roofline_ms": roof_ms}
        if args.quantization == "fp8" and device.type == "cuda":  # the quantiser as a separate pass
            producers.FUSED_QUANT = False
            row["unfused_quant_ms"] = timed_ms(step_call(model, rows), args.iters)[0]
            producers.FUSED_QUANT = True
        if device.type == "cuda" and rows <= gemv_module.GEMV_MAX_ROWS:
            row["kernels"] = kernels_per_step(model, rows)
            limit, gemv_module.GEMV_MAX_ROWS = gemv_module.GEMV_MAX_ROWS, 0  # every matmul on cuBLAS
            row["cublas_ms"] = timed_ms(step_call(model, rows), args.iters)[0]
            row["cublas_kernels"] = kernels_per_step(model, rows)
            gemv_module.GEMV_MAX_ROWS = limit
        results.append(row)
        show(row | {"roofline_share": roof_ms / ms, "tokens_per_s": rows / ms * 1e3})
    return {"preset": args.preset, "device": str(device), "copy_peak_gbs": peak, "steps": results}


if __name__ == "__main__":
    main()
