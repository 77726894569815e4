"""Compile sdpa_varlen's kernels for sm_90 without a GPU and print what decides their speed.

For each variant: registers and stack (spills) from the cubin, shared memory, cp.async / mma /
wgmma counts, and the hot loop's instruction mix (the backward branch enclosing the most MMA
instructions): barriers, local-memory accesses (spills inside the loop), ldmatrix, smem traffic.
Uses whatever Triton is importable, so the GPU machine's version can be checked here too:

    python bench/kernel_bench.py --compile-sm90 ""
    PYTHONPATH=/path/to/triton-3.6 python bench/kernel_bench.py --compile-sm90 ""    # pip install --target
    SASS_DIR=/tmp/sass python bench/kernel_bench.py --compile-sm90 e4m3  # labels with "e4m3", hot loops' SASS kept
    TTGIR_DIR=/tmp/ir ...                                                 # each variant's TTGIR kept
The loop's instruction count covers both sides of the in-loop mask branch (edge and interior key
blocks), so it is an upper bound on what one iteration issues; compare variants by it.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import mangle_type
from triton.tools.tensor_descriptor import TensorDescriptor

from batchkv.models.gemv import _gemv_kernel
from batchkv.ops.kv_write_triton import _kv_write_kernel
from batchkv.ops.sdpa.kernels import split_kernel
from batchkv.ops.sdpa.long import long_kernel
from batchkv.ops.sdpa.splitkv import splitkv_merge, splitkv_partials

CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
TARGET = GPUTarget("cuda", 90, 32)


def pow2_floor(x: int) -> int:
    return 1 << (max(1, x).bit_length() - 1)


def hot_body(sass: str) -> list[str]:
    """Instructions of the backward branch's body that holds the most MMA instructions."""
    code = sorted((int(m[1], 16), m[2]) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass))
    best: list[str] = []
    for addr, ins in code:
        m = re.search(r"BRA\s+(?:[A-Z0-9!]+,\s*)?0x([0-9a-f]+)", ins)
        if m and int(m[1], 16) < addr:
            body = [i for a, i in code if int(m[1], 16) <= a <= addr]
            if sum("MMA" in i for i in body) > sum("MMA" in i for i in best):
                best = body
    return best


def hot_loop(best: list[str]) -> str:
    """The hot loop's instruction mix."""
    if not best:
        return "no loop"
    count = {k: sum(k in i for i in best) for k in ("MMA", "BAR.SYNC", "LDGSTS", "LDL", "STL", "LDSM", "SHFL", "F2FP")}
    return f"loop: {len(best)} instr " + " ".join(f"{k.lower()}={v}" for k, v in count.items())


def build(fn, types: dict, consts: dict, warps: int, stages: int, label: str, aligned: tuple = ()) -> None:
    """Compile `fn` for sm_90 and print one line; SASS_DIR (env) also gets the hot loop's SASS per label.
    `aligned`: integer arguments taken as multiples of 16, as Triton specialises them at launch."""
    if consts.get("QUANT"):  # the store's scale planes have row stride 1, which Triton specialises as a constant
        consts = {**consts, "stride_sr": 1}
    # soft-capping and sinks: off unless a variant asks (the kernels compile as before them)
    consts = {**{n: False for n in ("SOFTCAP", "SINKS") if n in fn.arg_names}, **consts}
    if "HEAD_DIM" in consts:  # keys and values of one width, a power of two, unless a variant says otherwise
        widths = {n: consts["HEAD_DIM"] for n in ("K_DIM", "V_TILE", "V_DIM") if n in fn.arg_names}
        widths |= {"SAME_STRIDES": True} if "SAME_STRIDES" in fn.arg_names else {}  # V in K's layout
        consts = {**widths, **consts}
    types = {"sinks": "*fp32", "cap2": "fp32", **types}
    sig = {n: ("constexpr" if n in consts else types.get(n, "i32")) for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
             if n not in consts and (sig[n].startswith("*") or n.startswith("stride") or n in aligned)}  # fmt: skip
    try:
        k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs), target=TARGET,
                           options={"num_warps": warps, "num_stages": stages})  # fmt: skip
    except Exception as exc:
        print(f"{label:44s} FAILED {type(exc).__name__}: {str(exc)[-600:]}")
        return
    ptx = k.asm["ptx"]
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        res = subprocess.run([str(CUOBJDUMP), "-res-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([str(CUOBJDUMP), "-sass", f.name], capture_output=True, text=True).stdout
    body = hot_body(sass)
    name = re.sub(r"[^A-Za-z0-9.]+", "_", label.strip())
    if os.environ.get("SASS_DIR"):  # the hot loop's SASS, one file per variant
        (Path(os.environ["SASS_DIR"]) / f"{name}.sass").write_text("\n".join(body) + "\n")
    if os.environ.get("TTGIR_DIR"):  # Triton's GPU IR: where tiles are loaded, converted, stored to smem
        (Path(os.environ["TTGIR_DIR"]) / f"{name}.ttgir").write_text(k.asm["ttgir"])
    regs, stack = re.search(r"REG:(\d+)", res), re.search(r"STACK:(\d+)", res)
    print(f"{label:44s} regs={regs[1] if regs else '?'} stack={stack[1] if stack else '?'} "
          f"smem={k.metadata.shared} cp.async={ptx.count('cp.async.cg')} mma={ptx.count('mma.sync')} "
          f"wgmma={ptx.count('wgmma.mma_async')} gdc={ptx.count('griddepcontrol')} "
          f"prefetch={ptx.count('prefetch.global.L2')} | {hot_loop(body)}")  # fmt: skip


def split(dtype="bf16", D=128, G=4, heads=1, block_n=64, warps=4, stages=3, skip=True, merge_tile=8192,
          warp_split=1, prefetch=0, store=None):  # fmt: skip
    """One split-kernel variant; `store` "fp8e4nv" compiles the e4m3 path (q in `dtype`, dots in fp16)."""
    block_q = max(1, 16 // G)
    block_m = max(16, triton.next_power_of_2(block_q * G))
    merge_rows = min(block_m, triton.next_power_of_2(G))
    hg = triton.next_power_of_2(heads * G)
    store = store or dtype
    types = dict(q=f"*{dtype}", k_store=f"*{store}", v_store=f"*{store}", k_scale="*fp32", v_scale="*fp32",
                 info="*i32", live="*i32", out=f"*{dtype}", o_part="*fp32", lse_part="*fp32", counters="*i32",
                 qk_scale="fp32")  # fmt: skip
    consts = dict(QUANT=store == "fp8e4nv", CAUSAL=True, GROUP=G, HEADS=heads, HEAD_DIM=D, BLOCK_M=block_m, GDC=True,
                  BLOCK_Q=block_q, BLOCK_N=block_n, Q_SHORT=16, S_POW2=128, MIN_BLOCKS=1, LONG=True, SKIP_MASKS=skip,
                  MERGE_ROWS=merge_rows, MERGE_SLOTS=min(64, pow2_floor(merge_tile // (heads * merge_rows * D))),
                  HG_POW2=hg, ZERO_ROWS=pow2_floor(2048 // (hg * D)), AXIS64=False, TABLE_CHUNK=128,
                  DOT_PREC="ieee" if dtype == "fp32" else "tf32", WARP_SPLIT=warp_split, PREFETCH=prefetch,
                  SECTOR={"fp32": 8, "fp8e4nv": 32}.get(store, 16), PREFETCH_CHECK=False,
                  MERGE_STAGES=1, CVT_ASM=store == "fp8e4nv")  # fmt: skip
    label = f"split {'e4m3/' if store != dtype else ''}{dtype} D{D} G{G} heads{heads} n{block_n} w{warps} s{stages}" + (
        "" if skip else " masked"
    )
    label += (f" ws{warp_split}" if warp_split > 1 else "") + (f" pf{prefetch}" if prefetch else "")
    build(split_kernel, types, consts, warps, stages, label)


def long(dtype="bf16", D=128, G=4, block_m=128, block_n=64, warps=8, stages=3, store=None, qk_e4m3=False, tma=False):
    """A long-path variant; `qk_e4m3`: QK^T as an e4m3 dot (an e4m3 store); `tma`: interior K/V tiles by TMA."""
    block_q = max(1, block_m // G)
    store = store or dtype
    desc = f"*{store}"
    if tma:  # the type Triton's launcher gives a host descriptor of [block_n, D] boxes
        torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
                       "fp8e4nv": torch.float8_e4m3fn}[store]  # fmt: skip
        desc = mangle_type(TensorDescriptor(torch.empty(8, D, dtype=torch_dtype), [8, D], [D, 1], [block_n, D]))
    types = dict(q=f"*{dtype}", k_store=f"*{store}", v_store=f"*{store}", k_scale="*fp32", v_scale="*fp32",
                 info="*i32", live="*i32", out=f"*{dtype}", k_desc=desc, v_desc=desc, qk_scale="fp32")  # fmt: skip
    tile_m = max(16, triton.next_power_of_2(block_q * G))
    consts = dict(QUANT=store == "fp8e4nv", QK_E4M3=qk_e4m3, HW_CAST=True, CAUSAL=True, GROUP=G, HEAD_DIM=D, GDC=True,
                  BLOCK_M=tile_m, BLOCK_Q=block_q, BLOCK_N=block_n, Q_SHORT=16, S_POW2=128, TABLE_CHUNK=128,
                  DOT_PREC="ieee" if dtype == "fp32" else "tf32", TMA=tma)  # fmt: skip
    label = f"long {'e4m3/' if store != dtype else ''}{dtype}{' qk-e4m3' * qk_e4m3} D{D}{' tma' * tma}"
    build(long_kernel, types, consts, warps, stages, f"{label} G{G} m{block_m} n{block_n} w{warps} s{stages}")


def splitkv(dtype="bf16", D=128, G=4, block_n=64, warps=4, stages=3, store=None, T=1, S=16, write=False):
    """split_merge's two kernels (`splitkv.py`): T tokens over an S-row table; `write`: the K/V write fused."""
    store = store or dtype
    block_m = max(16, triton.next_power_of_2(T * G))
    types = dict(q=f"*{dtype}", k_store=f"*{store}", v_store=f"*{store}", k_scale="*fp32", v_scale="*fp32",
                 info="*i32", out=f"*{dtype}", o_part="*fp32", lse_part="*fp32", qk_scale="fp32", new_k=f"*{dtype}",
                 new_v=f"*{dtype}", slots="*i64")  # fmt: skip
    s_pow2 = max(16, triton.next_power_of_2(S))
    consts = dict(QUANT=store == "fp8e4nv", CAUSAL=True, GROUP=G, HEAD_DIM=D, BLOCK_M=block_m, BLOCK_N=block_n,
                  S_POW2=s_pow2, SKIP_MASKS=True, DOT_PREC="ieee" if dtype == "fp32" else "tf32",
                  SECTOR={"fp32": 8, "fp8e4nv": 32}.get(store, 16), CVT_ASM=store == "fp8e4nv", GDC=True,
                  WRITE=write, W_POW2=triton.next_power_of_2(T))  # fmt: skip
    kind = f"splitkv{' write' if write else ''} {'e4m3/' if store != dtype else ''}{dtype}"
    label = f"{kind} D{D} G{G} T{T} S{S} n{block_n} w{warps} s{stages}"
    build(splitkv_partials, types, consts, warps, stages, label)
    merge = dict(GROUP=G, HEAD_DIM=D, S_POW2=s_pow2, MERGE_SLOTS=64, GDC=True)  # as launched on sm_90
    build(splitkv_merge, types, merge, 4, 3, f"splitkv merge {dtype} D{D} G{G} S{S}")


def gemv(block_n=32, block_k=256, stages=5):
    """The few-row linear kernel (`batchkv.models.gemv`) on bf16, launched with PDL as on sm_90."""
    types = dict(x_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16")
    consts = dict(BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, DOT_PREC="tf32", GDC=True)
    label = f"gemv n{block_n} k{block_k} s{stages}"
    build(_gemv_kernel, types, consts, 4, stages, label, aligned=("N", "K"))  # as Triton specialises 8B's shapes


def kv_write(dtype="bf16", D=128, store="fp8e4nv", heads=8, rope=0):
    """The step's K/V write (`kv_write_triton.py`); `store` "fp8e4nv": quantising; `rope`: q heads rotated."""
    types = dict(k_flat=f"*{store}", v_flat=f"*{store}", slots="*i64", k_scale="*fp32", v_scale="*fp32",
                 **{name: f"*{dtype}" for name in ("k", "v", "q", "q_out", "cos", "sin")})  # fmt: skip
    consts = dict(HKV=heads, H_POW2=triton.next_power_of_2(heads), HEAD_DIM=D, QUANT=store == "fp8e4nv", GDC=True,
                  ROPE=rope > 0, HQ=rope or 1, HQ_POW2=triton.next_power_of_2(rope or 1))  # fmt: skip
    label = f"kv_write {'e4m3/' if store != dtype else ''}{dtype} D{D} H{heads}" + (f" rope Hq{rope}" if rope else "")
    build(_kv_write_kernel, types, consts, 4, 3, label)


VARIANTS = [  # (function, keyword arguments)
    (split, {}),  # b1 / narrow steps
    (split, dict(heads=4, block_n=16, warps=4)),  # wide steps (the default from 16 tokens)
    (split, dict(heads=2, block_n=16, warps=2)),
    (split, dict(heads=8, block_n=16, warps=8)),
    (split, dict(skip=False)),
    (split, dict(D=256, block_n=32)),
    (split, dict(D=64, G=8, block_n=128)),
    (split, dict(warp_split=4)),  # few-row variants (SdpaConfig.warp_split, .prefetch)
    (split, dict(warp_split=2, warps=2)),
    (split, dict(warp_split=4, block_n=128, stages=2)),
    (split, dict(prefetch=2)),
    (split, dict(warp_split=4, prefetch=2)),
    (split, dict(store="fp8e4nv", block_n=128)),  # e4m3 stores: the default tile (~32 KiB of K+V per stage)
    (split, dict(store="fp8e4nv", block_n=64)),
    (split, dict(store="fp8e4nv", heads=2, block_n=64, warps=2)),
    (split, dict(store="fp8e4nv", dtype="fp32", block_n=64)),
    (split, dict(store="fp8e4nv", warp_split=4, block_n=128)),
    (split, dict(store="fp8e4nv", D=16, block_n=64)),  # D = 16: one dot over the re-interleaved K tile
    (split, dict(store="fp8e4nv", D=16, heads=2, block_n=16, warps=2)),
    (split, dict(store="fp8e4nv", D=16, dtype="fp32", block_n=64)),
    (split, dict(store="fp8e4nv", D=16, warp_split=4, block_n=128)),
    (long, {}),  # the default prefill tile (16-bit stores)
    (long, dict(block_m=64, warps=4, stages=2)),  # the one before it
    (long, dict(D=256, block_m=64, block_n=32, stages=2)),
    (long, dict(block_n=128, stages=2)),  # the Hopper tile of Triton's attention tutorial (128 x 128, 8 warps)
    (long, dict(tma=True)),  # SdpaConfig.tma_long: interior K/V tiles by TMA
    (long, dict(tma=True, block_n=128, stages=2)),
    (long, dict(store="fp8e4nv")),  # e4m3 prefill: Triton's own conversion of 8-bit tiles
    (long, dict(store="fp8e4nv", dtype="fp32", block_m=64, block_n=32, stages=2)),
    (long, dict(store="fp8e4nv", D=16)),
    (long, dict(store="fp8e4nv", qk_e4m3=True)),  # SdpaConfig.e4m3_qk_long: QK^T an e4m3 dot
    (long, dict(store="fp8e4nv", qk_e4m3=True, block_n=128)),
    (long, dict(store="fp8e4nv", qk_e4m3=True, stages=4)),
    (long, dict(store="fp8e4nv", qk_e4m3=True, block_m=64, warps=4)),
    (long, dict(store="fp8e4nv", qk_e4m3=True, block_m=64, block_n=128, warps=4, stages=2, tma=True)),  # its tiles
    (long, dict(store="fp8e4nv", qk_e4m3=True, D=32, G=1)),
    (long, dict(store="fp8e4nv", qk_e4m3=True, D=256, block_m=64, block_n=32, stages=2)),
    (splitkv, {}),  # SdpaConfig.split_merge: one decoding sequence
    (splitkv, dict(block_n=128, warps=8)),
    (splitkv, dict(store="fp8e4nv", block_n=128)),
    (splitkv, dict(S=128)),  # the engine's table at 64 sequences
    (splitkv, dict(T=16, S=128)),  # 16 tokens: 64-row tiles, the tallest taken
    (splitkv, dict(T=16, S=128, store="fp8e4nv", block_n=128)),
    (splitkv, dict(write=True)),  # SdpaConfig.fuse_write: the step's K/V stored by the partials kernel
    (splitkv, dict(write=True, store="fp8e4nv", block_n=128)),
    (splitkv, dict(write=True, T=16, S=128)),
    (kv_write, {}),  # the e4m3 write (a row holding a NaN or an infinity: NaN scale, codes 0x7F)
    (kv_write, dict(dtype="fp32", D=16, heads=3)),
    (kv_write, dict(store="bf16")),
    (kv_write, dict(rope=32)),  # RoPE in the write: the 8B shape's 32 query heads, an e4m3 store
    (kv_write, dict(store="bf16", D=64, heads=3, rope=9)),  # SmolLM2's, a bf16 store
    (gemv, {}),  # o and down
    (gemv, dict(block_n=64)),  # q/k/v, the LM head
]


def main(only: str = "") -> None:
    """Compile every variant whose label contains `only` (all when empty), e.g. "e4m3"."""
    print(f"triton {triton.__version__}, sm_90")
    for fn, kwargs in VARIANTS:
        if only in ("e4m3" if "store" in kwargs else "") + fn.__name__ + str(kwargs):
            fn(**kwargs)
