"""The FP8 ceilings and a workload's limit at them (bench/anchors.py, bench/decode.py's fp8 parts)."""

from __future__ import annotations

import torch

from bench.lib.ceilings import matmul_peak
from bench.lib.roofline import causal_pairs
from bench.lib.timing import time_calls


def fp8_peak(device: torch.device) -> float:
    """TFLOP/s of e4m3 GEMMs through torch's scaled matmul with row-wise scales (as `Fp8Linear` runs
    them; fast accumulation), best of two shapes; the bf16 peak's on the CPU (no FP8 there)."""
    if device.type != "cuda":
        return matmul_peak(device)[0]
    from batchkv.models.quant import fp8 as fp8_module

    best = 0.0
    for m, n, k in ((8192, 8192, 8192), (16384, 16384, 8192)):
        a = torch.randn(m, k, device=device).to(torch.float8_e4m3fn)
        b = torch.randn(n, k, device=device).to(torch.float8_e4m3fn)
        sa, sb = torch.ones(m, 1, device=device), torch.ones(1, n, device=device)

        def call(a=a, b=b, sa=sa, sb=sb):
            return torch._scaled_mm(a, b.T, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,
                                    use_fast_accum=fp8_module.FAST_ACCUM)  # fmt: skip

        us, _ = time_calls([call], replays=20)
        best = max(best, 2 * m * n * k / us / 1e6)
        del a, b
    return best


def limit(prompts, outputs, config: dict, *, fp8: bool, kv_bytes_per_pos: int, read_gbps: float,
          bf16_tflops: float, fp8_tflops: float) -> dict:  # fmt: skip
    """The workload's limit (module docstring): {"overlap", "serial"} tokens/s and the terms."""
    h, i, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    hq, hkv = config["num_attention_heads"], config["num_key_value_heads"]
    d = h // hq
    body = layers * (h * (hq + 2 * hkv) * d + hq * d * h + 3 * h * i)
    head = config["vocab_size"] * h
    pair = 4 * d * hq * layers
    body_flops = other_flops = kv_bytes = 0
    for prompt, out in zip(prompts, outputs, strict=True):
        p, fed = len(prompt), out - 1
        body_flops += 2 * body * (p + fed)
        other_flops += 2 * head * out + pair * (causal_pairs(p, p) + fed * p + fed * (fed + 1) // 2 + fed)
        kv_bytes += kv_bytes_per_pos * (fed * (p + 1) + fed * (fed + 1) // 2)
    body_rate = fp8_tflops if fp8 else bf16_tflops
    flop_s = body_flops / (body_rate * 1e12) + other_flops / (bf16_tflops * 1e12)
    weight_bytes = body * (1 if fp8 else 2) + head * 2
    byte_s = (kv_bytes + max(outputs) * weight_bytes) / (read_gbps * 1e9)
    tokens = sum(outputs)
    return {"overlap": tokens / max(flop_s, byte_s), "serial": tokens / (flop_s + byte_s), "flop_s": flop_s,
            "byte_s": byte_s, "body_flops": body_flops, "other_flops": other_flops, "kv_read_bytes": kv_bytes,
            "weight_bytes": weight_bytes}  # fmt: skip
