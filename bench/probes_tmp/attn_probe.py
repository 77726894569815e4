"""Probe: sdpa_varlen on a one-column pool store (the engine's layout), serving-like tables, timed as CUDA
graphs of CALLS calls. Run from the tree to measure; OUT/attn-<TAG>.json. --small: CPU interpreter smoke."""
import json, os, sys, time
import numpy as np, torch
sys.path.insert(0, os.getcwd())
from batchkv.ops.sdpa.launch import SdpaConfig, sdpa_varlen
from batchkv.ops.support import empty_scales

small = "--small" in sys.argv
dev = "cpu" if small else "cuda"
rng = np.random.default_rng(0)
SMOL, L8 = (9, 3, 64), (32, 8, 128)
SMOL1H, SMOL1H128 = (3, 1, 192), (3, 1, 128)  # the same bytes per position as one head of 192 (or 128) columns

def serve_kv(n):  # prompt U[64, 2048] + progress U[0, output U[64, 1024]]
    return (rng.integers(64, 2049, n) + rng.integers(0, rng.integers(64, 1025, n) + 1)).tolist()

def case(shape, decode_kv, chunks=(), S=None, hint=16, e4m3=False, pad=False):
    """S None: the engine's min(max_segments, width) at a padded width; pad: T padded to the next power of two."""
    return dict(shape=shape, decode_kv=decode_kv, chunks=list(chunks), S=S, hint=hint, e4m3=e4m3, pad=pad)

KV256, KV150 = serve_kv(256), serve_kv(150)
CASES = {
    "smol-b256": case(SMOL, KV256), "smol-b150": case(SMOL, KV150, pad=True),
    "smol1h-b256": case(SMOL1H, KV256), "smol1h-b150": case(SMOL1H, KV150, pad=True),
    "smol1h128-b150": case(SMOL1H128, KV150, pad=True), "smol-S2048-b150": case(SMOL, KV150, pad=True, S=2048),
    "smol-S512-b150": case(SMOL, KV150, pad=True, S=512),
    "smol-prefill-8x512": case(SMOL, [], [(512, 512 * (1 + i % 4)) for i in range(8)], S=64, hint=None),
    "smol-b256-mixed4096": case(SMOL, KV256, [(1024, 1024 + 512 * i) for i in range(4)], S=2048, hint=None),
    "smol-b64": case(SMOL, serve_kv(64)), "smol-b16": case(SMOL, serve_kv(16)),
    "smol-b150-mixed": case(SMOL, serve_kv(150), [(1024, 1024 + 512)], S=2048, hint=None),
    "smol-b256-e4m3": case(SMOL, serve_kv(256), e4m3=True),
    "l8-d256-std": case(L8, serve_kv(256), S=512), "l8-d256-std-e4m3": case(L8, serve_kv(256), S=512, e4m3=True),
    "l8-d1024-short": case(L8, rng.integers(129, 257, 1024).tolist(), S=2048),
    "l8-d1024-short-e4m3": case(L8, rng.integers(129, 257, 1024).tolist(), S=2048, e4m3=True),
    "l8-mixed-e4m3": case(L8, rng.integers(129, 257, 1024).tolist(), [(128, 128 * (1 + i % 2)) for i in range(32)],
                          S=2048, hint=None, e4m3=True),
    "l8-prefill-4x1024-e4m3": case(L8, [], [(1024, 3072)] * 4, S=64, hint=None, e4m3=True),
    "l8-mixed": case(L8, rng.integers(129, 257, 1024).tolist(), [(128, 128 * (1 + i % 2)) for i in range(32)],
                     S=2048, hint=None),
    # the serving graph's width: T padded to 8,192 (rows past the step's tokens are zeroed; long programs past
    # the last block exit after their table scan)
    "smol-b256-mixed4096-pad": case(SMOL, KV256, [(1024, 1024 + 512 * i) for i in range(4)], S=2048, hint=None,
                                    pad=True),
    "smol-b150-mixed-pad": case(SMOL, KV150, [(1024, 1024 + 512)], S=2048, hint=None, pad=True),
}
if small:
    CASES = {"smol-b4": case((4, 2, 32), [50, 70, 9, 130], S=16), "mixed": case((4, 2, 32), [40, 90], [(20, 30)], S=16,
             hint=None, e4m3=True)}

def build(c):
    hq, hkv, d = c["shape"]
    segs = [(1, kv) for kv in c["decode_kv"]] + c["chunks"]  # (q_len, kv_end)
    T = sum(q for q, _ in segs)
    if c["pad"]:
        T = 1 << (T - 1).bit_length()
    S = c["S"] or T
    total = sum(kv for _, kv in segs) + 64
    dt = torch.float32 if small else torch.bfloat16
    k = torch.randn(total, 1, hkv, d, device=dev, dtype=dt)
    v = torch.randn(total, 1, hkv, d, device=dev, dtype=dt)
    ks = vs = None
    if c["e4m3"]:
        k, v = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
        ks, vs = empty_scales(total, 1, hkv, device=dev), empty_scales(total, 1, hkv, device=dev)
        ks.fill_(0.5); vs.fill_(0.5)
    info = torch.zeros(S, 4, dtype=torch.int32)
    q_start, base = 0, 0
    for i, (ql, kv) in enumerate(segs):
        info[i] = torch.tensor([q_start, ql, base, kv]); q_start += ql; base += kv
    q = torch.randn(T, hq, d, device=dev, dtype=dt)
    nbytes = sum(kv for _, kv in segs) * hkv * d * 2 * k.element_size()
    live = torch.tensor([len(segs)], dtype=torch.int32, device=dev)
    return q, k, v, ks, vs, info.to(dev), nbytes, live

def run(c, calls, config=None, use_live=False):
    q, k, v, ks, vs, info, nbytes, live = build(c)
    out = torch.empty_like(q)
    cfg = SdpaConfig(**config) if config else None
    f = lambda: sdpa_varlen(q, k, v, info, out=out, k_scale=ks, v_scale=vs, rows=1 << 20, max_q_len=c["hint"],
                            config=cfg, live=live if use_live else None)
    f()
    if os.environ.get("NCU"):  # one call inside the profiler's range (ncu --profile-from-start off)
        torch.cuda.synchronize(); torch.cuda.cudart().cudaProfilerStart(); f(); torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        return {"ncu": True}
    if small:
        return {"ok": bool(torch.isfinite(out).all())}
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            f()
    g.replay(); torch.cuda.synchronize()
    times = []
    for _ in range(7):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    us = float(np.median(times))
    kernels = {}
    if os.environ.get("PROF"):  # each kernel's mean device time over `calls` eager calls
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                f()
            torch.cuda.synchronize()
        for e in prof.key_averages():
            t_us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
            if t_us:
                kernels[e.key[:32]] = round(t_us / calls, 2)
    return {"us": us, "us_min": min(times), "gbps": nbytes / us / 1e3, "mb": nbytes / 1e6, "T": q.shape[0],
            "S": info.shape[0], **({"kernels": kernels} if kernels else {})}

configs = json.loads(os.environ.get("CONFIGS", "[null]"))  # SdpaConfig overrides to sweep (null: the default)
res = {"tag": os.environ.get("TAG", "x"), "configs": configs, "cases": {}}
only = [a for a in sys.argv[1:] if not a.startswith("--")]
for name in only or list(CASES):  # the cases named, exactly and in that order, else all
    c = CASES[name]
    for config, use_live in [(cf, lv) for cf in configs for lv in json.loads(os.environ.get("LIVE", "[false]"))]:
        key = name if config is None else name + " " + json.dumps(config, separators=(",", ":"))
        key += " live" if use_live else ""
        t = time.perf_counter()
        try:
            res["cases"][key] = run(c, 20, config, use_live)
        except Exception as e:  # noqa: BLE001
            res["cases"][key] = {"error": repr(e)[:300]}
        print(key, res["cases"][key], f"{time.perf_counter() - t:.1f}s", flush=True)
out = os.environ.get("OUT", "/tmp/out"); os.makedirs(out, exist_ok=True)
open(f"{out}/attn-{res['tag']}.json", "w").write(json.dumps(res, indent=1))
