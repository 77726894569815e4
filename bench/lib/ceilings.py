"""Measured ceilings of the device, each the best of a few variants (CUDA-graph replay, median).

- copy: device-to-device copy, bytes read + written per second / 1e9 (memcpy and an elementwise
  copy kernel, 1 and 4 GiB), kept for comparison with earlier runs;
- read: read-only streaming, bytes read per second / 1e9 (reductions over 4 GiB of bf16): the
  ceiling of attention, which reads K/V and writes almost nothing;
- matmul: dense bf16 GEMM TFLOP/s (8192^3 and 16384 x 16384 x 8192), the compute ceiling of a
  prefill-heavy step; fp8: the same shapes in e4m3 as `Fp8Linear` runs them.

On CPU (smoke runs) the sizes shrink to a few MiB and the numbers only exercise the code.
"""

from __future__ import annotations

import torch

from .timing import time_calls


def _gib(device: torch.device) -> tuple[int, ...]:
    return (1, 4) if device.type == "cuda" else (1 / 256,)  # type: ignore[return-value]


def copy_ceiling(device: torch.device) -> tuple[float, dict[str, float]]:
    """(best GB/s, {variant: GB/s}) of device-to-device copies; bytes read + written."""
    variants: dict[str, float] = {}
    for gib in _gib(device):
        nbytes = int(gib * (1 << 30))
        src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
        dst = torch.empty_like(src)
        us, _ = time_calls([lambda src=src, dst=dst: dst.copy_(src)], replays=20)
        variants[f"memcpy_{gib:g}gib"] = round(2 * nbytes / us / 1e3, 1)
        us, _ = time_calls([lambda src=src, dst=dst: torch.mul(src, 1, out=dst)], replays=20)
        variants[f"elementwise_{gib:g}gib"] = round(2 * nbytes / us / 1e3, 1)
        del src, dst
    return max(variants.values()), variants


def read_ceiling(device: torch.device) -> tuple[float, dict[str, float]]:
    """(best GB/s, {variant: GB/s}) of read-only reductions over bf16; bytes read only."""
    nbytes = int(_gib(device)[-1] * (1 << 30))
    x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    rows = x.view(-1, 8192)
    row_out = torch.empty(rows.shape[0], dtype=torch.float32, device=device)
    max_out = torch.empty(rows.shape[0], dtype=torch.bfloat16, device=device)
    kinds = {
        "sum": lambda: torch.sum(x, dtype=torch.float32),  # (sum takes no out= beside dtype=)
        "row_sum": lambda: torch.sum(rows, dim=1, dtype=torch.float32, out=row_out),
        "row_max": lambda: torch.amax(rows, dim=1, out=max_out),
    }
    variants = {}
    for name, fn in kinds.items():
        try:
            us, _ = time_calls([fn], replays=20)
            variants[f"{name}_{nbytes / (1 << 30):g}gib"] = round(nbytes / us / 1e3, 1)
        except Exception as exc:  # a variant this torch cannot run is left out, and says so
            variants[f"{name}_failed"] = f"{type(exc).__name__}: {exc}"[:200]  # type: ignore[assignment]
    numbers = [v for v in variants.values() if isinstance(v, float)]
    return max(numbers), variants


def matmul_peak(device: torch.device, fp8: bool = False) -> tuple[float, dict[str, float]]:
    """(best TFLOP/s, {shape: TFLOP/s}) of dense GEMMs `a [m, k] @ b [k, n]` in bf16, or with `fp8` in
    e4m3 through torch's scaled matmul with row-wise scales as `Fp8Linear` runs them (fast
    accumulation; on the CPU, which has no FP8, the float32 figure)."""
    cuda = device.type == "cuda"
    shapes = ((8192, 8192, 8192), (16384, 16384, 8192)) if cuda else ((256, 256, 256),)
    dtype = torch.bfloat16 if cuda else torch.float32
    variants = {}
    for m, n, k in shapes:
        a = torch.randn(m, k, dtype=dtype, device=device)
        b = torch.randn(k, n, dtype=dtype, device=device)
        if fp8 and cuda:
            from batchkv.models.quant import fp8 as fp8_module

            a, b = a.to(torch.float8_e4m3fn), b.T.contiguous().to(torch.float8_e4m3fn).T  # b column-major
            sa, sb = torch.ones(m, 1, device=device), torch.ones(1, n, device=device)

            def call(a=a, b=b, sa=sa, sb=sb):
                return torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16,
                                        use_fast_accum=fp8_module.FAST_ACCUM)  # fmt: skip
        else:
            c = torch.empty(m, n, dtype=dtype, device=device)

            def call(a=a, b=b, c=c):
                return torch.mm(a, b, out=c)

        us, _ = time_calls([call], replays=20)
        variants[f"{m}x{n}x{k}"] = float(f"{2 * m * n * k / us / 1e6:.4g}")  # 4 digits: a CPU rate is under 0.1
        del a, b
    return max(variants.values()), variants
