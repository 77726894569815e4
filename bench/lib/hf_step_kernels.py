"""Kernels launched and GPU time per decode step of a transformers model served through HFModel,
with transformers' RMSNorm modules and RoPE as they are against one kernel each (`batchkv.models.hf_norms`,
`batchkv.models.hf_rope`).

A random-weight Llama of SmolLM2-135M's shape (hidden 576, 30 layers, 9 / 3 heads of 64,
intermediate 1536, vocabulary 49152, tied head; bf16) runs in an `Engine` with CUDA graphs: `--rows`
requests of a 64-token prompt, decoded until every one is past its prompt, then `--steps` steps
timed (wall clock) and as many profiled (torch.profiler: the kernels inside the graph replays, their
count and summed time per step, and the names that take the most). Also: the norm kernel against
transformers' op sequence on the device (max |difference| at the served shapes), and whether the
first requests' greedy tokens agree between the two runs (random weights have near-ties: a rate, not
a check). `--fp8` adds a third run with the decoder's projections in e4m3 (`quantization="fp8"`).

    python3 bench/lib/hf_step_kernels.py --rows 256 --steps 20 --fp8 --json $OUT/hf-step-kernels.json
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

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout: batchkv
from batchkv.executor import Engine, Request, SamplingParams
from batchkv.models import fused, hf_norms, hf_rope
from batchkv.models.hf import HFModel, quantize_decoder

SMOLLM2 = {
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
}
PROMPT = 64


def build(fuse: bool, fp8: bool) -> HFModel:
    """The SmolLM2-shaped Llama (seed 0) on the GPU through HFModel, its norms and RoPE fused when `fuse`."""
    import transformers

    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMOLLM2)).to(torch.bfloat16)
    with torch.no_grad():
        for p in hf.parameters():  # the default init's norm weights are all 1: make them differ
            if p.dim() == 1:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    hf = hf.cuda().eval()
    if fp8:
        quantize_decoder(hf)
    hf_norms.FUSE = hf_rope.FUSE = fuse
    try:
        return HFModel(hf)
    finally:
        hf_norms.FUSE = hf_rope.FUSE = True


def kernel_events(prof) -> list:
    return [e for e in prof.events() if e.device_type.name == "CUDA" and not e.name.startswith(("Memcpy", "Memset"))]


def run(label: str, fuse: bool, fp8: bool, rows: int, steps: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    model = build(fuse, fp8)
    norms = sum(isinstance(m, hf_norms.FusedRMSNorm) for m in model.hf.modules())
    ropes = sum("forward" in m.__dict__ for m in model.hf.modules())
    engine = Engine(model, max_seqs=rows, capacity=PROMPT + 64 + 4 * steps + 64, use_graphs=True)
    params = SamplingParams(max_new_tokens=64 + 4 * steps, ignore_eos=True)
    ids = []
    for i in range(rows):
        ids.append(engine.submit(Request([(i * 131 + j * 7) % 49000 + 10 for j in range(PROMPT)], params)))
    tokens: dict[int, list[int]] = collections.defaultdict(list)
    started: set[int] = set()

    def step() -> int:
        events = engine.step()
        for event in events:
            if event.token is not None:
                started.add(event.request_id)
                if event.request_id in ids[:8]:
                    tokens[event.request_id].append(event.token)
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
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    events = kernel_events(prof)
    by_name: dict[str, list[float]] = collections.defaultdict(list)
    for e in events:
        by_name[e.name].append(e.time_range.elapsed_us())
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:12]
    out = {
        "label": label,
        "norm_modules_swapped": norms,
        "attention_modules_with_fused_rope": ropes,
        "running": engine.num_running,
        "tokens_per_step": decoded / steps,
        "wall_ms_per_step": round(wall_ms, 3),
        "kernels_per_step": round(len(events) / steps, 1),
        "gpu_kernel_ms_per_step": round(sum(sum(v) for v in by_name.values()) / steps / 1e3, 3),
        "top_kernels": [
            {"name": name[:90], "per_step": round(len(v) / steps, 1), "ms_per_step": round(sum(v) / steps / 1e3, 4)}
            for name, v in top
        ],
        "first_tokens": {str(i): tokens[i][:16] for i in ids[:8]},
    }
    engine.close()
    return out


def kernel_error() -> dict:
    """The norm and RoPE kernels against transformers' op sequences on the device at the served
    shapes (bf16): max |difference| and how many elements differ."""
    g = torch.Generator(device="cuda").manual_seed(0)
    out = {}

    def record(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        diff = (got.float() - want.float()).abs()
        out[name] = {"max_abs": diff.max().item(), "differ": int((diff > 0).sum()), "of": diff.numel()}

    for name, shape in (("hidden_256x576", (1, 256, 576)), ("head_256x9x64", (1, 256, 9, 64))):
        x = torch.randn(shape, generator=g, device="cuda").to(torch.bfloat16) * 3
        w = (1 + 0.2 * torch.randn(shape[-1], generator=g, device="cuda")).to(torch.bfloat16)
        for form, (offset, first) in {"llama": (0.0, True), "gemma": (1.0, False)}.items():
            got = fused.rms_norm(x, w, 1e-5, offset=offset, round_first=first)
            record(f"norm_{name}_{form}", got, fused.rms_norm_torch(x, w, 1e-5, offset, first))
    q = torch.randn(1, 256, 9, 64, generator=g, device="cuda").to(torch.bfloat16).transpose(1, 2)
    k = torch.randn(1, 256, 3, 64, generator=g, device="cuda").to(torch.bfloat16).transpose(1, 2)
    angle = torch.rand(1, 256, 64, generator=g, device="cuda") * 6.3
    cos, sin = angle.cos().to(torch.bfloat16), angle.sin().to(torch.bfloat16)
    for part, got, want in zip("qk", fused.rope_qk(q, k, cos, sin), fused.rope_qk_torch(q, k, cos, sin), strict=True):
        record(f"rope_{part}_256x64", got, want)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--fp8", action="store_true", help="also a run with e4m3 projections (fused norms)")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    try:
        result["kernel_error"] = kernel_error()
    except Exception as exc:  # a probe: the step runs still report
        result["kernel_error"] = {"error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(result["kernel_error"]), flush=True)
    runs = [("transformers_ops", False, False), ("fused_norms_rope", True, False)]
    if args.fp8:
        runs.append(("fused_norms_rope_fp8", True, True))
    result["runs"] = []
    for label, fuse, fp8 in runs:
        try:
            r = run(label, fuse, fp8, args.rows, args.steps)
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
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
