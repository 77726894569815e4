"""Probe (#38): the SmolLM2-135M shape (random bf16) on the standard workload; each step's wall time and
running sequences, a GPU profile of 5 steps at three points (256 running after the queue drained, 60% of the
output, 16 running or fewer), cProfile of 20 steps at 40% of the output, Python's GC pauses.
Env: OUT (results), MST (max_step_tokens, 1024), PLAIN=1 (no profiling: the throughput), KV=e4m3.
Writes $OUT/trace.json and $OUT/cprofile.txt. Run from the tree to measure: python3 bench/smol_trace.py"""
import cProfile, io, json, os, pstats, sys, time
from pathlib import Path
import torch
sys.path.insert(0, os.getcwd())
from batchkv.models.hf import HFModel
from bench.anchors import build
from bench.lib.serving import serving_engine, workload, warm_up, sync
from batchkv.executor import Request, SamplingParams
if os.environ.get("SDPA"):  # SdpaConfig overrides for every attention call of the engine (an A/B of one choice)
    import dataclasses
    import batchkv.ops.sdpa.launch as _launch
    _launch.DEFAULT_CONFIG = dataclasses.replace(_launch.DEFAULT_CONFIG, **json.loads(os.environ["SDPA"]))

if os.environ.get("WRITE_ROPE") == "0":  # A/B: RoPE as its own kernel before the K/V write
    import batchkv.models.hf_rope as _hf_rope
    _hf_rope.WRITE_ROPE = False
SMOL = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
            num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0,
            tie_word_embeddings=True)
out = Path(os.environ.get("OUT", "/tmp/out")); out.mkdir(parents=True, exist_ok=True)
dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
small = dev.type == "cpu"
mst = int(os.environ.get("MST", "1024"))
plain = os.environ.get("PLAIN") == "1"
kv = torch.float8_e4m3fn if os.environ.get("KV") == "e4m3" else None
n, pr, orr = (8, (8, 64), (4, 32)) if small else (256, (64, 2048), (64, 1024))
prompts, outputs = workload(n, pr, orr, 49152)
model = HFModel(build(SMOL if not small else {**SMOL, "num_hidden_layers": 2}, dev))
engine = serving_engine(model, dev, prompts, outputs, "auto", max_step_tokens=mst, kv_dtype=kv)
if os.environ.get("PB"):
    engine.scheduler.prefill_budget = int(os.environ["PB"])
warm_s = None
if not small:
    _w = time.perf_counter(); warm_up(engine, dev, prompts, outputs); sync(dev); warm_s = time.perf_counter() - _w
captures_warm = engine.runner.captures if hasattr(engine, "runner") else None
engine.clear_prefix_cache()
for p, o in zip(prompts, outputs):
    engine.submit(Request(p, SamplingParams(max_new_tokens=o, ignore_eos=True)))
sync(dev)
from torch.profiler import ProfilerActivity, profile

def prof(k):
    running = engine.num_running
    try:
        positions = int(engine.cache._len.sum())
    except AttributeError:
        positions = None
    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as p:
        for _ in range(k):
            engine.step()
        sync(dev)
    wall = (time.perf_counter() - t) / k * 1e3
    ev = [e for e in p.events() if e.device_type.name == "CUDA"]
    byname = {}
    for e in ev:
        byname[e.name[:60]] = byname.get(e.name[:60], 0) + e.device_time / k / 1e3
    top = sorted(byname.items(), key=lambda x: -x[1])[:25]
    spans = sorted((e.time_range.start, e.time_range.end) for e in ev)
    union, cur = 0, None
    for s, e in spans:
        if cur is None or s > cur[1]:
            if cur: union += cur[1] - cur[0]
            cur = [s, e]
        else:
            cur[1] = max(cur[1], e)
    if cur: union += cur[1] - cur[0]
    span = (spans[-1][1] - spans[0][0]) if spans else 0
    order = [(e.name[:40], round(e.device_time, 1)) for e in sorted(ev, key=lambda e: e.time_range.start)]
    cpu = sorted(((e.key, e.self_cpu_time_total / k / 1e3) for e in p.key_averages()), key=lambda x: -x[1])[:25]
    return {"running": running, "kv_positions": positions, "wall_ms": wall, "kernels_per_step": len(ev) / k, "busy_ms": sum(e.device_time for e in ev) / k / 1e3,
            "union_ms": union / k / 1e3, "span_ms": span / k / 1e3, "top_kernels_ms": top, "cpu_self_ms": cpu, "order": order[: len(order) // k]}

import gc
pauses, _t0 = [], [0.0]
def _cb(phase, info):
    if phase == "start": _t0[0] = time.perf_counter()
    else: pauses.append((info["generation"], round((time.perf_counter() - _t0[0]) * 1e3, 3), len(steps)))
gc.callbacks.append(_cb)
steps, profs, cprof = [], {}, None
start = time.perf_counter(); tokens = 0; total = sum(outputs)
while engine.has_work:
    r = engine.num_running
    if plain:
        pass
    elif not small and len(steps) == 12 and "pre" not in profs:
        profs["pre"] = prof(1); continue
    elif not small and r <= 256 and "full" not in profs and engine.num_waiting == 0 and len(steps) > 50:
        profs["full"] = prof(5); continue
    elif not small and tokens > total * 0.6 and "mid" not in profs:
        profs["mid"] = prof(5); continue
    elif not small and r <= 16 and len(steps) > 50 and "tail" not in profs:
        profs["tail"] = prof(5); continue
    if not plain and cprof is None and tokens > total * 0.4:
        cprof = cProfile.Profile(); cprof.enable(); t = time.perf_counter()
        for _ in range(20): engine.step()
        cprof.disable(); steps.append({"cprofile_ms": (time.perf_counter() - t) / 20 * 1e3}); continue
    t = time.perf_counter()
    ev = engine.step()
    tokens += sum(e.token is not None for e in ev)
    steps.append({"ms": (time.perf_counter() - t) * 1e3, "running": r, "tokens": len(ev)})
sync(dev)
wall = time.perf_counter() - start
s = io.StringIO()
if cprof: pstats.Stats(cprof, stream=s).sort_stats("tottime").print_stats(40)
s2 = io.StringIO()
if cprof: pstats.Stats(cprof, stream=s2).sort_stats("cumulative").print_stats(40)
if cprof: (out / "cprofile.txt").write_text(s.getvalue() + "\n\n" + s2.getvalue())
buckets = {}
for st in steps:
    if "ms" not in st: continue
    b = min((x for x in (1, 8, 16, 32, 64, 128, 192, 256, 1024) if st["running"] <= x))
    buckets.setdefault(b, []).append(st["ms"])
import statistics
res = {"write_rope": os.environ.get("WRITE_ROPE") != "0", "warm_up_s": warm_s, "captures_after_warm_up": captures_warm, "captures_end": getattr(getattr(engine, "runner", None), "captures", None), "sdpa_env": os.environ.get("SDPA"), "gc": [p for p in pauses if p[0] == 2 or p[1] > 2], "gc_n": len(pauses), "gc_ms": sum(p[1] for p in pauses), "gc_objects": len(gc.get_objects()), "mst": mst, "plain": plain, "kv": str(kv), "tokens": tokens, "wall_s": wall, "tokens_per_s_approx": total / wall, "steps": len(steps), "profiles": profs,
       "prefill_budget": engine.scheduler.prefill_budget, "step_p99_ms": sorted(x["ms"] for x in steps if "ms" in x)[int(0.99 * sum("ms" in x for x in steps))], "buckets": {b: {"n": len(v), "p50": statistics.median(v), "sum_s": sum(v) / 1e3} for b, v in sorted(buckets.items())},
       "series": [(round(s.get("ms", 0), 3), s.get("running"), s.get("tokens")) for s in steps]}
(out / "trace.json").write_text(json.dumps(res, indent=1))
print(json.dumps({k: v for k, v in res.items() if k in ("write_rope", "prefill_budget", "step_p99_ms", "warm_up_s", "captures_after_warm_up", "captures_end", "mst", "wall_s", "tokens_per_s_approx", "steps", "buckets")}, indent=1))
for k, v in profs.items():
    print(k, {x: v[x] for x in ("running", "kv_positions", "wall_ms", "kernels_per_step", "busy_ms", "union_ms", "span_ms")})
    for name, ms in v["top_kernels_ms"][:14]:
        print(f"   {k} {ms * 1e3:9.1f} us  {name}")
print(s.getvalue()[:6000])
