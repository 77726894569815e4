"""Where an FP8 decode step's matmul time goes, per GEMM shape and row count, and what else could run it.

For each decoder projection shape of `--preset` (qkv, o, gate_up, down: one weight per layer, so
every weight is read from HBM) and each of `--rows`, times one step's worth of that projection
(all layers, captured in one CUDA graph) as:

- `bf16`: cuBLAS on the model-dtype weights (F.linear);
- `rowwise`: torch's scaled matmul with per-row / per-channel scales (what `Fp8Linear` runs above
  FP8_GEMV_MAX_ROWS rows; CUTLASS on sm_90), fast accumulation;
- `tensorwise`: the scaled matmul with scalar scales (cuBLASLt), the same codes: the GEMM alone,
  without applying the per-row / per-channel scales (the ceiling of a GEMM with a scale epilogue);
- `triton_*` / `tma_*`: a Triton e4m3 GEMM with the per-row / per-channel scales in its epilogue
  (`fp8_matmul_triton`), pointer loads or TMA descriptors, per tile configuration;

and the activation passes around them: `quantize_rows` (the separate quantiser), `add_rms_norm` and
`silu_mul` against `add_rms_norm_quant` and `silu_mul_quant` (the quantiser fused into them).
Every Triton configuration's product is checked against the emulation (`max_rel_err`).

    python3 bench/model_step.py --gemm-ab --rows 64 128 256 384 512 1024 --json out.json     # on the GPU
    python3 bench/model_step.py --gemm-ab --triton --llama ...   # also Triton GEMMs and Llama-3.1-8B shapes
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout: bench.lib and batchkv
from batchkv.models import preset_config
from batchkv.models.fused import add_rms_norm, silu_mul
from batchkv.models.quant import fp8 as fp8_module
from batchkv.models.quant import producers
from batchkv.ops.pdl import pdl_enter, pdl_kwargs
from bench.lib.timing import capture


@triton.jit
def _tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    num_m, num_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = GROUP_M * num_n
    first = (pid // group) * GROUP_M
    size = tl.minimum(num_m - first, GROUP_M)
    return first + (pid % group) % size, (pid % group) // size


@triton.jit
def _fp8_mm_epilogue(acc, sx_ptr, sw_ptr, out_ptr, M, N, pm, pn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    m = pm * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    sx = tl.load(sx_ptr + m, mask=m < M, other=0.0)
    sw = tl.load(sw_ptr + n, mask=n < N, other=0.0)
    out = (acc * sx[:, None] * sw[None, :]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + m.to(tl.int64)[:, None] * N + n[None, :], out, mask=(m < M)[:, None] & (n < N)[None, :])


@triton.jit
def _fp8_mm_kernel(x_ptr, sx_ptr, w_ptr, sw_ptr, out_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, GDC: tl.constexpr):  # fmt: skip
    pdl_enter(GDC)
    pm, pn = _tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm = (pm * BLOCK_M + tl.arange(0, BLOCK_M)) % M  # rows past the end repeat a real row (not stored)
    rn = (pn * BLOCK_N + tl.arange(0, BLOCK_N)) % N
    k = tl.arange(0, BLOCK_K)
    x_at = x_ptr + rm.to(tl.int64)[:, None] * K + k[None, :]
    w_at = w_ptr + rn.to(tl.int64)[:, None] * K + k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for _ in range(0, tl.cdiv(K, BLOCK_K)):  # K a multiple of BLOCK_K
        acc = tl.dot(tl.load(x_at), tl.trans(tl.load(w_at)), acc)
        x_at += BLOCK_K
        w_at += BLOCK_K
    _fp8_mm_epilogue(acc, sx_ptr, sw_ptr, out_ptr, M, N, pm, pn, BLOCK_M, BLOCK_N)


@triton.jit
def _fp8_mm_tma_kernel(x_desc, sx_ptr, w_desc, sw_ptr, out_ptr, M, N, K, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                       GDC: tl.constexpr):  # fmt: skip
    pdl_enter(GDC)
    pm, pn = _tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = x_desc.load([pm * BLOCK_M, k0])
        w = w_desc.load([pn * BLOCK_N, k0])
        acc = tl.dot(x, w.T, acc)
    _fp8_mm_epilogue(acc, sx_ptr, sw_ptr, out_ptr, M, N, pm, pn, BLOCK_M, BLOCK_N)


def fp8_matmul_triton(
    xq: torch.Tensor, sx: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor, dtype: torch.dtype, *, block_m: int = 128,
    block_n: int = 128, block_k: int = 128, num_stages: int = 4, num_warps: int = 8, group_m: int = 8,
    tma: bool = False,
) -> torch.Tensor:  # fmt: skip
    """`fp8_matmul_emulated` in one Triton launch: an e4m3 GEMM (float32 sums) with the per-row and
    per-channel scales in its epilogue; K a multiple of `block_k`. `tma`: loads through TMA descriptors
    (sm_90+). Capturable. (Measured here against the scaled matmul; the library does not run it.)"""
    (m, k), n = xq.shape, wq.shape[0]
    out = torch.empty(m, n, dtype=dtype, device=xq.device)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    consts = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "GROUP_M": group_m, "num_warps": num_warps,
              "num_stages": num_stages, **pdl_kwargs(xq.device)}  # fmt: skip
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        x_desc = TensorDescriptor(xq, [m, k], [xq.stride(0), 1], [block_m, block_k])
        w_desc = TensorDescriptor(wq, [n, k], [wq.stride(0), 1], [block_n, block_k])
        _fp8_mm_tma_kernel[grid](x_desc, sx, w_desc, sw, out, m, n, k, **consts)
    else:
        _fp8_mm_kernel[grid](xq, sx, wq, sw, out, m, n, k, **consts)
    return out


# (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps)
POINTER_CONFIGS = [(64, 128, 128, 4, 4), (64, 256, 128, 3, 8), (128, 128, 128, 4, 8), (128, 256, 128, 3, 8),
                   (128, 64, 128, 4, 4), (64, 64, 256, 4, 4)]  # fmt: skip
TMA_CONFIGS = [(64, 128, 128, 4, 4), (128, 128, 128, 4, 8), (128, 256, 128, 3, 8), (64, 256, 128, 4, 8)]


DEVICE = "cuda"


def graph_ms(fn, iters: int) -> float:
    """Mean ms of `fn()` replayed from one CUDA graph (wall clock of one call on the CPU: smoke runs)."""
    if DEVICE != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    graph = capture(fn)
    for _ in range(2):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    end.synchronize()
    graph.reset()
    return start.elapsed_time(end) / iters


def kernel_names(fn) -> list[str]:
    if DEVICE != "cuda":
        return []
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sorted({e.name for e in prof.events() if e.device_type.name == "CUDA"})


def gemm_variants(ws: list, rows: int, k: int, configs: list, out: dict, args, gen) -> dict:
    """ms of one step's worth (every weight in `ws` once) of each GEMM variant at `rows` rows."""
    dev = ws[0][0].device
    x = torch.randn(rows, k, generator=gen, device=dev).to(torch.bfloat16)
    xq, sx = fp8_module.quantize_rows(x)
    one = torch.ones((), device=dev)

    def rowwise(q, s):
        return torch._scaled_mm(xq, q.T, scale_a=sx, scale_b=s.view(1, -1), out_dtype=torch.bfloat16,
                                use_fast_accum=True)  # fmt: skip

    def tensorwise(q, s):
        return torch._scaled_mm(xq, q.T, scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=True)

    def each(fn):
        return lambda: [fn(q, s) for _, q, s in ws]

    def tensorwise_f32_scaled(q, s):
        y = torch._scaled_mm(xq, q.T, scale_a=one, scale_b=one, out_dtype=torch.float32, use_fast_accum=True)
        return fp8_module.apply_scales(y, sx, s, torch.bfloat16)

    def tensorwise_bf16_scaled(q, s):
        return fp8_module.apply_scales(tensorwise(q, s), sx, s, torch.bfloat16)

    sx_t = sx.reshape(1, -1)

    def rowwise_transposed(q, s):  # y.T = W x.T, then copied back to [M, N]
        y = torch._scaled_mm(q, xq.T, scale_a=s.view(-1, 1), scale_b=sx_t, out_dtype=torch.bfloat16,
                             use_fast_accum=True)  # fmt: skip
        return y.T.contiguous()

    def dispatch(q, s):  # what Fp8Linear runs (the module's TENSORWISE rule)
        return fp8_module.fp8_matmul(xq, sx, q, s, torch.bfloat16)

    res = {"bf16": graph_ms(lambda: [F.linear(x, w) for w, _, _ in ws], args.iters)}
    for name, fn in [("rowwise", rowwise), ("tensorwise", tensorwise), ("tensorwise_f32_scaled", tensorwise_f32_scaled),
                     ("tensorwise_bf16_scaled", tensorwise_bf16_scaled), ("rowwise_transposed", rowwise_transposed),
                     ("dispatch", dispatch)]:  # fmt: skip
        res[name] = graph_ms(each(fn), args.iters)
    if rows == 256:  # the products against the emulation (relative to the largest output)
        _, q, s = ws[0]
        want = fp8_module.fp8_matmul_emulated(xq, sx, q, s, torch.bfloat16).float()
        checked = [
            ("rowwise", rowwise),
            ("tensorwise_f32_scaled", tensorwise_f32_scaled),
            ("tensorwise_bf16_scaled", tensorwise_bf16_scaled),
            ("rowwise_transposed", rowwise_transposed),
        ]
        for name, fn in checked:
            out["errors"].setdefault(name, {})[f"{q.shape[0]}x{k}"] = float(
                (fn(q, s).float() - want).abs().max() / want.abs().max())  # fmt: skip
    if rows <= 128:
        res["gemv"] = graph_ms(each(lambda q, s: fp8_module.fp8_gemv(xq, sx, q, s, torch.bfloat16)), args.iters)
    if rows == 256:
        _, q, s = ws[0]
        named = [
            ("rowwise", rowwise),
            ("tensorwise", tensorwise),
            ("tensorwise_f32_scaled", tensorwise_f32_scaled),
            ("rowwise_transposed", rowwise_transposed),
        ]
        out["kernels"][f"{q.shape[0]}x{q.shape[1]}"] = {
            name: kernel_names(lambda fn=fn: fn(q, s)) for name, fn in named
        }
    for kind, (bm, bn, bk, st, wp) in configs:
        key = f"{kind}_{bm}x{bn}x{bk}_s{st}w{wp}"

        def call(q, s, bm=bm, bn=bn, bk=bk, st=st, wp=wp, tma=kind == "tma"):
            return fp8_matmul_triton(xq, sx, q, s, torch.bfloat16, block_m=bm, block_n=bn, block_k=bk,
                                                num_stages=st, num_warps=wp, tma=tma)  # fmt: skip

        try:
            errors = out["errors"].setdefault(key, {})
            shape = f"{ws[0][1].shape[0]}x{k}"
            if shape not in errors:
                _, q, s = ws[0]
                got = call(q, s).float()
                want = fp8_module.fp8_matmul_emulated(xq, sx, q, s, torch.bfloat16).float()
                errors[shape] = float((got - want).abs().max() / want.abs().max())
            res[key] = graph_ms(each(call), args.iters)
        except Exception as exc:  # a configuration that does not compile or fit is recorded
            out["errors"].setdefault(key, {})[f"rows {rows}"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            if DEVICE == "cuda":
                torch.cuda.synchronize()
    return res


def passes(rows: int, h: int, inter: int, norms: int, silus: int, iters: int, gen) -> dict:
    """ms of one step's activation passes (`norms` add-RMSNorms of [rows, h], `silus` SiLU-muls of
    [rows, 2 inter]), with the quantiser separate and fused."""
    dev = torch.device(DEVICE)
    hh, dd = (torch.randn(rows, h, generator=gen, device=dev).to(torch.bfloat16) for _ in range(2))
    nw = torch.randn(h, generator=gen, device=dev).to(torch.bfloat16)
    gu = torch.randn(rows, 2 * inter, generator=gen, device=dev).to(torch.bfloat16)
    mid = torch.randn(rows, inter, generator=gen, device=dev).to(torch.bfloat16)
    p = {
        "add_rms_norm": graph_ms(lambda: [add_rms_norm(hh, dd, nw, 1e-6) for _ in range(norms)], iters),
        "quantize_rows_h": graph_ms(lambda: [fp8_module.quantize_rows(hh) for _ in range(norms)], iters),
        "add_rms_norm_quant": graph_ms(
            lambda: [producers.add_rms_norm_quant(hh, dd, nw, 1e-6) for _ in range(norms)], iters
        ),
        "silu_mul": graph_ms(lambda: [silu_mul(gu) for _ in range(silus)], iters),
        "quantize_rows_i": graph_ms(lambda: [fp8_module.quantize_rows(mid) for _ in range(silus)], iters),
        "silu_mul_quant": graph_ms(lambda: [producers.silu_mul_quant(gu) for _ in range(silus)], iters),
    }
    block = producers.SILU_QUANT_BLOCK
    for b in (1024, 4096, 1 << 30):  # chunk widths of the fused SiLU-mul quantiser (1 << 30: a whole row)
        producers.SILU_QUANT_BLOCK = b
        p[f"silu_mul_quant_block{min(b, 1 << 20)}"] = graph_ms(
            lambda: [producers.silu_mul_quant(gu) for _ in range(silus)], iters)  # fmt: skip
    producers.SILU_QUANT_BLOCK = block
    p["separate_ms"] = p["add_rms_norm"] + p["quantize_rows_h"] + p["silu_mul"] + p["quantize_rows_i"]
    p["fused_ms"] = p["add_rms_norm_quant"] + p["silu_mul_quant"]
    return p


def main() -> None:
    parser = argparse.ArgumentParser(prog="bench/model_step.py --gemm-ab", description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="sensenova-u1-8b")
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 128, 256, 512, 1024])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--layers", type=int, default=0, help="weights per shape (0: the preset's layer count)")
    parser.add_argument("--llama", action="store_true", help="also Llama-3.1-8B's unfused and fused projection shapes")
    parser.add_argument("--triton", action="store_true", help="also the Triton GEMM configurations")
    parser.add_argument("--tensorwise", default="", help="the TENSORWISE rule for `dispatch`: a Python literal")
    parser.add_argument("--json")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of the script (interpreter, wall clock)")
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    dev = torch.device(DEVICE)
    if args.tensorwise:
        fp8_module.TENSORWISE = ast.literal_eval(args.tensorwise)
    cfg = preset_config(args.preset)
    layers = args.layers or cfg.num_layers
    h, inter = cfg.hidden, cfg.intermediate
    shapes = {"qkv": ((cfg.q_heads + 2 * cfg.kv_heads) * cfg.head_dim, h), "o": (h, cfg.q_heads * cfg.head_dim),
              "gate_up": (2 * inter, h), "down": (h, inter)}  # fmt: skip
    gen = torch.Generator(device=dev).manual_seed(0)
    weights = {}
    for name, (n, k) in shapes.items():
        ws = []
        for _ in range(layers):
            w = (torch.randn(n, k, generator=gen, device=dev) / k**0.5).to(torch.bfloat16)
            q, s = fp8_module.quantize_weight(w)
            ws.append((w, q, s))
        weights[name] = ws
    if DEVICE == "cuda":
        a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 2.0:  # clocks up
            a @ a
        torch.cuda.synchronize()
        del a
    name = torch.cuda.get_device_name(dev) if DEVICE == "cuda" else "cpu"
    out = {"preset": args.preset, "layers": layers, "device": name,
           "torch": torch.__version__, "shapes": {k: list(v) for k, v in shapes.items()}, "gemm_ms": {},
           "passes_ms": {}, "errors": {}, "kernels": {}}  # fmt: skip
    configs = [("triton", c) for c in POINTER_CONFIGS] + [("tma", c) for c in TMA_CONFIGS] if args.triton else []
    for rows in args.rows:
        for name, (n, k) in shapes.items():
            out["gemm_ms"][f"{name}/{rows}"] = res = gemm_variants(weights[name], rows, k, configs, out, args, gen)
            best = min(
                (v, key) for key, v in res.items() if key not in ("bf16", "tensorwise", "tensorwise_bf16_scaled")
            )
            tf = 2 * rows * n * k * layers / 1e9
            shown = "  ".join(f"{key} {v:.3f}" for key, v in res.items() if not key.startswith(("triton", "tma")))
            print(f"{name:8s} rows {rows:5d}: {shown}  best {best[1]} {best[0]:.3f} ms ({tf / best[0]:.0f} TFLOP/s)",
                  flush=True)  # fmt: skip
        out["passes_ms"][str(rows)] = p = passes(rows, h, inter, 2 * layers, layers, args.iters, gen)
        print(f"passes rows {rows:5d}: " + "  ".join(f"{key} {v:.3f}" for key, v in p.items()), flush=True)
        save(out, args.json)
    for name, (n, k) in {"llama_kv": (1024, 4096), "llama_gate": (14336, 4096), "llama_gate_up": (28672, 4096),
                         "llama_down": (4096, 14336)}.items() if args.llama else ():  # fmt: skip
        ws = []
        for _ in range(layers):
            w = (torch.randn(n, k, generator=gen, device=dev) / k**0.5).to(torch.bfloat16)
            ws.append((w, *fp8_module.quantize_weight(w)))
        for rows in (256, 1024):
            out["gemm_ms"][f"{name}/{rows}"] = res = gemm_variants(ws, rows, k, [], out, args, gen)
            print(f"{name:8s} rows {rows:5d}: " + "  ".join(f"{key} {v:.3f}" for key, v in res.items()), flush=True)
        del ws
    save(out, args.json)


def save(out: dict, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
