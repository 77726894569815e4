"""e4m3 K/V storage at SenseNova-U1-8B shapes: sdpa_varlen on bf16 and e4m3 stores, and what e4m3
storage does to the 8B model's next-token distributions.

(a) kernels. Hq 32, Hkv 8, D 128, a 65-column store of 16384 rows in bf16 and the same values as
    e4m3 codes with fp32 scales (laid out as the cache stores them), a 128-row seq_info, random
    distinct columns; each case draws its lengths from its own seed-0 generator (mixed: U[64,
    8192]). Time per call: median of >= 100 CUDA-graph replays of a graph holding K back-to-back
    calls, / K; calls rotate over R column
    sets so a case smaller than the L2 cache is still read from HBM (R from the e4m3 bytes, the
    smaller). Per case: batchkv_us (bf16), batchkv_fp8_us, fp8_ratio, GB/s of each (scales
    counted), and each path's max abs error against the torch reference on the same stored values.
(b) accuracy. build_model("sensenova-u1-8b", "cuda", seed=0) (random bf16 weights); 1024 random
    token ids (seed 0) teacher-forced in chunks of 256 through caches storing fp32, bf16 and e4m3
    K/V (every query reads the stored K/V, so this is what decode would see). Per position
    KL(bf16 || e4m3) and top-1 agreement, with KL(fp32 || bf16) beside them as the floor bf16
    storage itself sets, and the bf16 distributions' entropy and top-1 probability.
(c) --serve N (off by default): the engine with CUDA graphs, warmed on its first max_seqs prompts
    (8 tokens each: the step widths captured), then timed on N requests (prompts U[64, 2048],
    outputs U[64, 1024], seed 0, up to 64 sequences, as bench/decode.py serves), bf16 and e4m3
    storage: output tokens/s and their ratio; then e4m3 at twice the sequences.
--sweep: an e4m3 SdpaConfig grid on four cases (instead of (b) and (c)).
`SdpaConfig.e4m3_qk_long` (the long path's QK^T as an e4m3 dot of queries rounded to e4m3) is the
    default's on e4m3 stores, so (a)'s batchkv_fp8_us has it on prompt cases; (b) reads the `fp8`
    cache and (c) serves the `fp8` runs with it off (K converted: exact queries).
--qk-long: (a) also times QK_CONFIGS (it off and on, tiles) on the prompt cases (q_len > 16), as
    `fp8_qk` entries (config, us, ratio to bf16, max abs error against the reference on exact
    queries); (b) adds an `fp8_qk` cache read with it on (every position goes through the long path,
    chunks of 256: the variant's worst case, decode queries are not rounded); (c) adds the `fp8_qk`
    serving run, with it on (`--serve-runs` picks the runs).

JSON is written after every case and part, and each part runs under its own try and time box.
H200 (about 2-3 minutes for (a) and (b)):
    python3 bench/kv_fp8.py --out bench/results/kv-fp8-h200.json --kernels-json bench/results/kernels-h200.json
Smoke on CPU (Triton interpreter, tiny shapes, no graphs): python bench/kv_fp8.py --smoke --out /tmp/kv.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv:  # before Triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

from contextlib import contextmanager
from dataclasses import replace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from batchkv import BatchedSequenceCache, CacheConfig
from batchkv.ops import sdpa_varlen_reference
from batchkv.ops.sdpa import launch
from batchkv.ops.sdpa.launch import SdpaConfig, resolve_config, sdpa_varlen
from bench.lib.kernel_cases import e4m3_store
from bench.lib.timing import time_calls as lib_time_calls

FP8 = torch.float8_e4m3fn
CASES = {  # name: (batch, q_len, kv_end of each sequence, or None for U[64, 8192], or (lo, hi) for U[lo, hi])
    "b1-l1024": (1, 1, [1024]),
    "b1-l4096": (1, 1, [4096]),
    "b1-l9100": (1, 1, [9100]),
    "b1-l16384": (1, 1, [16384]),
    "b8-mixed": (8, 1, None),
    "b32-mixed": (32, 1, None),
    "b64-mixed": (64, 1, None),
    "b32-verify4": (32, 4, None),
    "b64-l512": (64, 1, [512] * 64),
    "b64-serve": (64, 1, (64, 3072)),  # the serving benchmark's histories (prompt U[64, 2048] + output U[64, 1024])
    "prefill-2x512": (2, 512, [2048, 1536]),  # two 512-token prompt chunks (long path), as a serving step's
}
SWEEP_CASES = ("b1-l4096", "b64-mixed", "b64-serve", "prefill-2x512")
SWEEP = [{}, {"block_n": 64}, {"block_n": 128, "num_stages": 4}, {"block_n": 64, "num_stages": 4},
         {"occupancy": 3}, {"occupancy": 1}, {"min_blocks": 2}, {"min_blocks": 4}, {"heads": 2, "occupancy": 4},
         {"block_m_long": 64, "num_warps_long": 4}, {"block_n_long": 128}, {"block_n_long": 32},
         {"num_stages_long": 2}, {"block_m_long": 64, "block_n_long": 128, "num_warps_long": 4}]  # fmt: skip

QK_CONFIGS = [{"e4m3_qk_long": False}, {"e4m3_qk_long": True}, {"e4m3_qk_long": True, "num_stages_long": 4},
              {"e4m3_qk_long": True, "block_m_long": 64, "num_warps_long": 4}]  # fmt: skip


@contextmanager
def qk_long(on: bool):
    """config=None calls (the model's) take `SdpaConfig.e4m3_qk_long=on` while inside (the default has
    it on; the narrow config too: a one-sequence cache's 2-row table takes it, for prompt chunks as well)."""
    default = launch.DEFAULT_CONFIG
    narrow = default.narrow and replace(default.narrow, e4m3_qk_long=on)
    launch.DEFAULT_CONFIG = replace(default, e4m3_qk_long=on, narrow=narrow)
    try:
        yield
    finally:
        launch.DEFAULT_CONFIG = default


class Shape:
    """Kernel geometry: the SenseNova decode shape, or a tiny one for the interpreter."""

    def __init__(self, smoke: bool) -> None:
        self.hq, self.hkv, self.d = (8, 2, 16) if smoke else (32, 8, 128)
        self.rows, self.columns, self.segments = (512, 65, 128) if smoke else (16384, 65, 128)
        self.mixed = (16, 400) if smoke else (64, 8192)
        self.device = "cpu" if smoke else "cuda"


class Case:
    """One case: lengths, R rotated column sets and their seq_info tables, q (bf16, or fp32 in smoke)."""

    def __init__(self, name: str, shape: Shape, l2_bytes: int, smoke: bool) -> None:
        batch, q_len, lengths = CASES[name]
        gen = torch.Generator().manual_seed(0)
        ranged = isinstance(lengths, tuple)
        (lo, hi), lengths = (lengths, None) if ranged else (shape.mixed, lengths)
        if smoke:  # the same pattern, shrunk: at most 4 sequences of at most `rows` keys, prompt chunks a 16th
            batch, lengths = min(batch, 4), [min(n // 32, shape.rows) for n in lengths[:4]] if lengths else None
            q_len = q_len // 16 if q_len > 16 else q_len
            lo, hi = (max(1, lo // 32), min(hi // 32, shape.rows)) if ranged else (lo, hi)
        self.name, self.batch, self.q_len = name, batch, q_len
        self.lengths = lengths or torch.randint(lo, hi + 1, (batch,), generator=gen).tolist()
        keys = sum(self.lengths) * shape.hkv * 2  # (position, head) rows of K and V
        self.bytes = {"bf16": keys * shape.d * 2, "fp8": keys * (shape.d + 4)}  # codes and fp32 scales
        self.rot = min(64, max(1, math.ceil(4 * l2_bytes / self.bytes["fp8"])))
        self.calls = max(self.rot, min(64, math.ceil(200 / (self.bytes["bf16"] / 3e6 + 5))))
        if smoke:  # the interpreter runs each call in seconds
            self.rot = self.calls = 1
        perm = torch.randperm(64, generator=gen).tolist()  # rotation j takes the next `batch` columns
        self.tables = []
        for j in range(self.rot):
            info = torch.zeros(shape.segments, 4, dtype=torch.int32)
            for b, kv_end in enumerate(self.lengths):
                info[b] = torch.tensor([b * q_len, q_len, perm[(j * batch + b) % 64], kv_end])
            self.tables.append(info.to(shape.device))
        dtype = torch.float32 if smoke else torch.bfloat16  # the interpreter has no bf16 dots
        self.q = torch.randn(batch * q_len, shape.hq, shape.d, generator=gen).to(shape.device, dtype)


# ---- timing ----------------------------------------------------------------------------------------
def time_calls(calls: list, replays: int) -> float:
    """Median µs per call of `calls` back to back, `replays` times: CUDA-graph replays on the GPU,
    wall time on the CPU (bench/lib/timing.py, with no time cap on the replays)."""
    return lib_time_calls(calls, replays, budget_s=float("inf"))[0]


def make_stores(shape: Shape, gen: torch.Generator) -> dict:
    """bf16 K, V [rows, C, Hkv, D] and their e4m3 codes and fp32 scale planes [rows, C, Hkv] in the
    store's layout (quantised 1024 rows at a time)."""
    size = (shape.rows, shape.columns, shape.hkv, shape.d)
    dtype = torch.float32 if shape.device == "cpu" else torch.bfloat16
    stores = {"bf16": {}, "fp8": {}}
    for name in ("k", "v"):
        x = torch.randn(size, generator=gen, device=shape.device).to(dtype)
        stores["bf16"][name] = x
        stores["fp8"][name], stores["fp8"][f"{name}_scale"] = e4m3_store(x)
    return stores


def kernel_call(case: Case, planes: dict, config: SdpaConfig | None):
    out = torch.empty_like(case.q)
    scales = {"k_scale": planes.get("k_scale"), "v_scale": planes.get("v_scale")}

    def call(j: int) -> torch.Tensor:
        info = case.tables[j % case.rot]
        return sdpa_varlen(case.q, planes["k"], planes["v"], info, out=out, config=config, **scales)

    return call


def max_error(case: Case, planes: dict, config: SdpaConfig | None) -> float:
    got = kernel_call(case, planes, config)(0).float()
    scales = {"k_scale": planes.get("k_scale"), "v_scale": planes.get("v_scale")}
    ref = sdpa_varlen_reference(case.q, planes["k"], planes["v"], case.tables[0], **scales).float()
    return (got - ref).abs().max().item()


def time_qk_long(entry: dict, case: Case, stores: dict, replays: int) -> None:
    """entry["fp8_qk"]: QK_CONFIGS on the e4m3 store, each timed and checked like the default."""
    entry["fp8_qk"] = runs = []
    for overrides in QK_CONFIGS:
        run = {"config": overrides}
        runs.append(run)
        try:
            cfg = SdpaConfig(**overrides)
            run["max_abs_err"] = float(f"{max_error(case, stores['fp8'], cfg):.3g}")
            call = kernel_call(case, stores["fp8"], cfg)
            run["us"] = round(time_calls([lambda j=j, call=call: call(j) for j in range(case.calls)], replays), 2)
            if entry.get("batchkv_us"):
                run["ratio_vs_bf16"] = round(run["us"] / entry["batchkv_us"], 3)
        except Exception as exc:
            run["error"] = f"{type(exc).__name__}: {exc}"[:300]
        print(f"{case.name:12s} fp8 {json.dumps(overrides)}: {run.get('us')} us  err {run.get('max_abs_err')}",
              run.get("error", ""), flush=True)  # fmt: skip


def kernels(report: dict, shape: Shape, stores: dict, names: list[str], replays: int, save, smoke: bool,
            qk: bool = False) -> None:  # fmt: skip
    l2 = torch.cuda.get_device_properties(0).L2_cache_size if torch.cuda.is_available() else 1 << 20
    dev = torch.device(shape.device)
    half = shape.device != "cpu"  # q is bf16 on the GPU, fp32 in the smoke run
    report["configs"] = {
        k: resolve_config(None, shape.d, s["k"].dtype, shape.hkv, dev, half).__dict__ for k, s in stores.items()
    }
    for name in names:
        case = Case(name, shape, l2, smoke)
        entry = {"name": name, "batch": case.batch, "q_len": case.q_len, "bytes": case.bytes["bf16"],
                 "bytes_fp8": case.bytes["fp8"], "rotations": case.rot, "calls_per_graph": case.calls}  # fmt: skip
        report["cases"].append(entry)
        for kind, key in (("bf16", "batchkv_us"), ("fp8", "batchkv_fp8_us")):
            try:
                entry[f"max_abs_err_{kind}"] = float(f"{max_error(case, stores[kind], None):.3g}")
                call = kernel_call(case, stores[kind], None)
                us = time_calls([lambda j=j, call=call: call(j) for j in range(case.calls)], replays)
                entry[key] = round(us, 2)
                entry[f"gbps_{kind}"] = round(case.bytes[kind] / us / 1e3, 1)
            except Exception as exc:  # recorded, and the next case runs
                entry[key] = None
                entry[f"error_{kind}"] = f"{type(exc).__name__}: {exc}"[:300]
        if entry.get("batchkv_us") and entry.get("batchkv_fp8_us"):
            entry["fp8_ratio"] = round(entry["batchkv_fp8_us"] / entry["batchkv_us"], 3)
        if qk and case.q_len > 16:  # a prompt case: the long path
            time_qk_long(entry, case, stores, replays)
        print(f"{name:12s} bf16 {entry.get('batchkv_us')} us  fp8 {entry.get('batchkv_fp8_us')} us  "
              f"ratio {entry.get('fp8_ratio')}  err {entry.get('max_abs_err_bf16')}/{entry.get('max_abs_err_fp8')}",
              flush=True)  # fmt: skip
        save()


def sweep(report: dict, shape: Shape, stores: dict, replays: int, save, smoke: bool) -> None:
    l2 = torch.cuda.get_device_properties(0).L2_cache_size if torch.cuda.is_available() else 1 << 20
    cases = [Case(n, shape, l2, smoke) for n in SWEEP_CASES]
    report["sweep"] = rows = []
    for overrides in SWEEP:
        row = {"config": overrides, "fp8_us": {}, "errors": {}}
        rows.append(row)
        for case in cases:
            try:
                cfg = SdpaConfig(**overrides)
                err = max_error(case, stores["fp8"], cfg)
                if not err < 3e-2:
                    raise RuntimeError(f"max abs error {err:.3g} against the reference")
                call = kernel_call(case, stores["fp8"], cfg)
                row["fp8_us"][case.name] = round(
                    time_calls([lambda j=j, call=call: call(j) for j in range(case.calls)], replays), 2
                )
            except Exception as exc:
                row["errors"][case.name] = f"{type(exc).__name__}: {exc}"[:300]
        print(f"sweep {json.dumps(overrides):45s} {row['fp8_us']} {row['errors'] or ''}", flush=True)
        save()


# ---- accuracy and serving ---------------------------------------------------------------------------
@torch.no_grad()
def accuracy(report: dict, preset: str, device: str, positions: int, chunk: int, qk: bool = False) -> None:
    from batchkv.models import build_model

    model = build_model(preset, device, seed=0)
    spec = model.cache_spec()
    tokens = torch.randint(0, model.vocab_size, (positions,), generator=torch.Generator().manual_seed(0))
    storage = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp8": FP8} | ({"fp8_qk": FP8} if qk else {})
    caches = {
        name: BatchedSequenceCache(CacheConfig(**spec, max_seqs=1, capacity=positions, max_write=chunk, kv_dtype=kv),
                                   device)
        for name, kv in storage.items()
    }  # fmt: skip
    stats = {"kl_fp8": [], "kl_bf16_floor": [], "agree_fp8": [], "agree_bf16_floor": [], "entropy": [], "p_top1": [],
             "kl_fp8_qk": [], "agree_fp8_qk": []}  # fmt: skip
    for start in range(0, positions, chunk):
        n = min(chunk, positions - start)
        ids = tokens[start : start + n].to(device)
        idx = torch.zeros(3, n, dtype=torch.int64, device=device)
        idx[0] = torch.arange(start, start + n, device=device)
        logp = {}
        for name, cache in caches.items():
            seq = 0 if cache.sequences else cache.seq_new()
            cache.declare_step([seq] * n)
            cache.prepare_step(n)
            with qk_long(name == "fp8_qk"):
                logp[name] = model(ids, idx, cache, torch.arange(n, device=device)).float().log_softmax(-1)
            cache.commit_step()
        p = logp["bf16"].exp()
        stats["kl_fp8"].append((p * (logp["bf16"] - logp["fp8"])).sum(-1))
        stats["kl_bf16_floor"].append((logp["fp32"].exp() * (logp["fp32"] - logp["bf16"])).sum(-1))
        stats["agree_fp8"].append((logp["bf16"].argmax(-1) == logp["fp8"].argmax(-1)).float())
        stats["agree_bf16_floor"].append((logp["fp32"].argmax(-1) == logp["bf16"].argmax(-1)).float())
        stats["entropy"].append(-(p * logp["bf16"]).sum(-1))
        stats["p_top1"].append(p.max(-1).values)
        if qk:
            stats["kl_fp8_qk"].append((p * (logp["bf16"] - logp["fp8_qk"])).sum(-1))
            stats["agree_fp8_qk"].append((logp["bf16"].argmax(-1) == logp["fp8_qk"].argmax(-1)).float())
    cat = {k: torch.cat(v).cpu() for k, v in stats.items() if v}
    report["accuracy"] = {
        "model": preset, "weights": "random bf16, seed 0", "positions": positions, "chunk": chunk,
        "tokens": "uniform random ids, seed 0",
        "mean_kl_bf16_vs_fp8": cat["kl_fp8"].mean().item(), "p99_kl_bf16_vs_fp8": cat["kl_fp8"].quantile(0.99).item(),
        "max_kl_bf16_vs_fp8": cat["kl_fp8"].max().item(), "top1_agreement_fp8": cat["agree_fp8"].mean().item(),
        "mean_kl_fp32_vs_bf16": cat["kl_bf16_floor"].mean().item(),
        "top1_agreement_fp32_vs_bf16": cat["agree_bf16_floor"].mean().item(),
        "mean_entropy_nats_bf16": cat["entropy"].mean().item(), "mean_p_top1_bf16": cat["p_top1"].mean().item(),
    }  # fmt: skip
    if qk:  # e4m3 storage read with SdpaConfig.e4m3_qk_long (queries rounded to e4m3 too)
        report["accuracy"].update(
            mean_kl_bf16_vs_fp8_qk=cat["kl_fp8_qk"].mean().item(),
            p99_kl_bf16_vs_fp8_qk=cat["kl_fp8_qk"].quantile(0.99).item(),
            top1_agreement_fp8_qk=cat["agree_fp8_qk"].mean().item(),
        )  # fmt: skip
    print("accuracy:", json.dumps(report["accuracy"]), flush=True)
    del model, caches


SERVE_RUNS = {"bf16": (None, 64, False), "fp8": (FP8, 64, False), "fp8_2x_seqs": (FP8, 128, False),
              "fp8_qk": (FP8, 64, True)}  # name: (kv_dtype, max_seqs, SdpaConfig.e4m3_qk_long)  # fmt: skip


def serve(report: dict, preset: str, device: str, requests: int, save, names: list[str]) -> None:
    import numpy as np

    from batchkv.models import build_model

    model = build_model(preset, device, seed=0)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, model.vocab_size, rng.integers(64, 2049)).tolist() for _ in range(requests)]
    outputs = rng.integers(64, 1025, requests).tolist()
    capacity = max(map(len, prompts)) + max(outputs) + 1
    report["serve"] = runs = {}
    for name in names:
        kv, seqs, qk = SERVE_RUNS[name]
        runs[name] = serve_one(model, prompts, outputs, capacity, device, kv, seqs, qk)
        print(f"serve {name}: {runs[name]['tokens_per_s']:.0f} tokens/s, {runs[name]['kv_gib']:.1f} GiB KV", flush=True)
        torch.cuda.empty_cache()
        save()
    for name in ("fp8", "fp8_qk"):
        if name in runs and "bf16" in runs:
            runs[f"{name}_vs_bf16"] = runs[name]["tokens_per_s"] / runs["bf16"]["tokens_per_s"]


def serve_one(model, prompts, outputs, capacity, device, kv, seqs, qk) -> dict:
    """One engine (CUDA graphs) warmed on its first max_seqs prompts, then timed on all requests."""
    from batchkv.executor import Engine, Request, SamplingParams

    with qk_long(qk):  # graphs are captured inside: the variant is baked into them
        engine = Engine(model, max_seqs=seqs, capacity=capacity, max_step_tokens=1024, prefill_chunk=512,
                        device=device, kv_dtype=kv, kv_positions=seqs * capacity)  # fmt: skip
        for p in prompts[:seqs]:  # warm-up: captures the step widths outside the timed run
            engine.submit(Request(p, SamplingParams(max_new_tokens=8)))
        engine.run_until_done()
        engine.metrics = engine.metrics.fresh()
        for p, o in zip(prompts, outputs, strict=True):
            engine.submit(Request(p, SamplingParams(max_new_tokens=o)))
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.run_until_done()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
        summary = engine.metrics.summary()
        run = {"max_seqs": seqs, "kv_gib": engine.cache.nbytes / 2**30, "wall_s": wall, "e4m3_qk_long": qk,
               "tokens_per_s": summary["generated_tokens"] / wall, "itl_ms_p50": summary["itl_ms_p50"],
               "itl_ms_p99": summary["itl_ms_p99"], "captures": summary["captures"]}  # fmt: skip
        del engine
    return run


def merge_into(path: Path, report: dict) -> None:
    """Add batchkv_fp8_us (and this run's bf16 ratio) to the cases of a bench/kernels.py JSON with the same names."""
    data = json.loads(path.read_text())
    ours = {c["name"]: c for c in report["cases"]}
    for case in data.get("cases", []):
        mine = ours.get(case.get("name"))
        if mine and mine.get("batchkv_fp8_us") is not None:
            case["batchkv_fp8_us"] = mine["batchkv_fp8_us"]
            case["fp8_ratio_same_run"] = mine.get("fp8_ratio")
    path.write_text(json.dumps(data, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results/kv-fp8-h200.json"))
    parser.add_argument("--kernels-json", type=Path, help="also add batchkv_fp8_us to this kernels benchmark JSON")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated case names")
    parser.add_argument("--replays", type=int, default=100)
    parser.add_argument("--positions", type=int, default=1024, help="(b): teacher-forced positions")
    parser.add_argument("--serve", type=int, default=0, metavar="N", help="(c): serve N requests (0: skip)")
    parser.add_argument("--sweep", action="store_true", help="an e4m3 SdpaConfig grid instead of (b) and (c)")
    parser.add_argument("--qk-long", action="store_true", help="also SdpaConfig.e4m3_qk_long in (a), (b), (c)")
    parser.add_argument("--serve-runs", help=f"(c): comma-separated, of {', '.join(SERVE_RUNS)} (default: all but "
                        "fp8_qk, which --qk-long adds)")  # fmt: skip
    parser.add_argument("--budget-s", type=float, default=150.0, help="skip (b) when (a) took longer than this")
    parser.add_argument("--smoke", action="store_true", help="CPU: tiny shapes under the Triton interpreter")
    args = parser.parse_args()
    unknown = set((args.serve_runs or "").split(",")) - set(SERVE_RUNS) - {""}
    if unknown:
        parser.error(f"--serve-runs: unknown {', '.join(sorted(unknown))}; choose from {', '.join(SERVE_RUNS)}")
    started = time.time()
    shape = Shape(args.smoke)
    report: dict = {"shape": vars(shape), "cases": [], "method": __doc__.split("\n\n")[0]}
    if torch.cuda.is_available():
        import triton

        report.update(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")

    stores = make_stores(shape, torch.Generator(device=shape.device).manual_seed(0))
    replays = 1 if args.smoke else max(100, args.replays)
    names = [n for n in args.cases.split(",") if n]
    if args.smoke and args.cases == parser.get_default("cases"):
        names = ["b1-l1024", "b8-mixed", "b32-verify4", "prefill-2x512"]  # every path: split, verify, long
    if args.sweep:
        sweep(report, shape, stores, replays, save, args.smoke)
        return
    kernels(report, shape, stores, names, replays, save, args.smoke, args.qk_long)
    del stores
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    report["kernels_s"] = round(time.time() - started, 1)
    if args.kernels_json and args.kernels_json.exists() and not args.smoke:
        merge_into(args.kernels_json, report)
    save()
    preset, device = ("sensenova-u1-tiny", "cpu") if args.smoke else ("sensenova-u1-8b", "cuda")
    if time.time() - started > args.budget_s:
        report["accuracy"] = f"skipped: the kernels took {report['kernels_s']} s, past --budget-s"
    else:
        try:
            accuracy(report, preset, device, 64 if args.smoke else args.positions, 32 if args.smoke else 256,
                     args.qk_long)  # fmt: skip
        except Exception as exc:
            report["accuracy"] = f"failed: {type(exc).__name__}: {exc}"[:300]
    report["accuracy_s"] = round(time.time() - started - report["kernels_s"], 1)
    save()
    if args.serve and torch.cuda.is_available():
        try:
            runs = args.serve_runs or ",".join(n for n in SERVE_RUNS if n != "fp8_qk" or args.qk_long)
            serve(report, preset, device, args.serve, save, [n for n in runs.split(",") if n])
        except Exception as exc:
            report["serve"] = f"failed: {type(exc).__name__}: {exc}"[:300]
        save()
    print(f"wrote {args.out} in {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
