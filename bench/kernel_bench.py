"""sdpa_varlen on SenseNova decode shapes: time, GB/s, % of the copy and read ceilings, beside its peers.

Cases and geometry: bench/lib/kernel_cases.py. Decode cases report GB/s of the valid K/V prefixes;
prefill cases also TFLOP/s (4 * D * Hq per attended (query, key) pair). Every time is the median
over CUDA-graph replays of a graph holding K back-to-back calls, divided by K (bench/lib/timing.py).
Ceilings (bench/lib/ceilings.py): device copy and read-only streaming; attention only reads K/V, so
`pct_of_read` is the honest figure, `pct_of_copy` is kept for comparison with earlier runs.

Peers, each tried every way it runs and the fastest that matches the reference kept (every try in `peer_candidates`;
bench/results/README.md "Method"): FlashInfer first, compiled before the budget starts (bench/lib/flashinfer_peer.py,
flashinfer_jit.py); SDPA over exact prefixes and padded + mask, and torch's varlen attention (kernel_peers.py);
flex_attention last, compiled per case (flex_peer.py: defaults first, then other knobs while the budget lasts).

    python3 bench/kernel_bench.py [--check] [--out bench/results/kernels-h200.json] [--budget-s 215]
    python bench/kernel_bench.py --small --check --out /tmp/k.json     # CPU smoke run (Triton interpreter)
    python3 bench/kernel_bench.py --e4m3 --out bench/results/kv-fp8-h200.json     # e4m3 K/V storage, no peers

--e4m3 times batchkv on the cases' store and on its e4m3 codes with fp32 scales (the cache's layout), instead of
the peers: `batchkv_fp8_us`, `gbps_fp8` (scales counted), `fp8_ratio`, each store's max abs error. --check first
compares batchkv with the reference on every case (recorded, not fatal); --compile-sm90 LABEL compiles the kernels
for sm_90 without a GPU (bench/lib/compile_sm90.py). Results are written after every case and peer; --resume FILE
completes a run that stopped early.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from functools import partial
from pathlib import Path

import torch

if not torch.cuda.is_available() and "--compile-sm90" not in sys.argv:  # no GPU: the Triton interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from batchkv.ops.sdpa.launch import SdpaConfig, resolve_config
from bench.lib.ceilings import copy_ceiling, read_ceiling
from bench.lib.flashinfer_jit import load as load_flashinfer
from bench.lib.flashinfer_peer import at_page, flashinfer
from bench.lib.flex_peer import flex, knob_sets
from bench.lib.kernel_cases import CASES, SMALL_CASES, TOLERANCE, Case, batchkv_calls, build_cases, e4m3_store
from bench.lib.kernel_peers import PEERS, varlen_api
from bench.lib.timing import Deadline, time_calls

FLEX_FIRST = ("b64-mixed", "b1-l1024", "b32-mixed", "b8-mixed", "b1-l9100", "b32-verify4", "b64-l512")


def write(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")


def check(cases: dict, k, v, report: dict) -> None:
    """batchkv against the reference on rotation 0 of every case (max abs error); loud, not fatal."""
    for name, case in cases.items():
        try:
            err = case.error(batchkv_calls(case, k, v, None)[0](), k, v)
            report[name] = err
            verdict = "ok" if err < TOLERANCE else "MISMATCH: batchkv disagrees with the reference"
            print(f"check {name}: batchkv max abs error {err:.2e} vs the torch reference: {verdict}")
        except Exception as exc:
            report[name] = f"failed: {type(exc).__name__}: {exc}"[:300]
            print(f"check {name}: FAILED {report[name]}")


def rates(case: Case, us: float, report: dict) -> dict:
    """GB/s of the valid prefixes, % of the copy and read ceilings, TFLOP/s."""
    gbps = case.bytes / us / 1e3
    return {"us": round(us, 2), "gbps": round(gbps, 1), "pct_of_copy": round(100 * gbps / report["copy_gbps"], 1),
            "pct_of_read": round(100 * gbps / report["read_gbps"], 1),
            "tflops": round(case.flops / us / 1e6, 1)}  # fmt: skip


def run_peer(entry: dict, peer: str, candidates, case: Case, k, v, deadline: Deadline, report: dict) -> None:
    """Time every candidate of `peer` into entry["peer_candidates"], keep the fastest correct one."""
    tried = entry["peer_candidates"].setdefault(peer, [])
    try:
        for cand in candidates:
            if deadline.left() <= 0:
                tried.append({"skipped": "kernels budget spent"})
                break
            row: dict = {"config": cand.config}
            tried.append(row)
            try:
                row["max_abs_err"] = float(f"{case.error(cand.output(), k, v):.3g}")
                if not row["max_abs_err"] < TOLERANCE:
                    row["refused"] = "disagrees with the reference"
                    continue
                us, row["timing"] = time_calls(cand.calls, budget_s=0.25)
                row["us"] = round(us, 2)
            except Exception as exc:  # a backend or knob that refuses the call is recorded as refused
                row["refused"] = f"{type(exc).__name__}: {exc}"[:240]
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
    except Exception as exc:  # the peer could not even set up (no such API, out of memory)
        tried.append({"refused": f"{type(exc).__name__}: {exc}"[:300]})
    timed = [r for r in tried if "us" in r]
    best = min(timed, key=lambda r: r["us"]) if timed else None
    if best is not None:
        config = {**best["config"], "timing": best["timing"], "max_abs_err": best["max_abs_err"]}
        entry["peers"][peer] = {"us": best["us"], "gbps": rates(case, best["us"], report)["gbps"], "config": config}
    else:
        entry["peers"].setdefault(peer, None)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def new_entry(case: Case, cfg: SdpaConfig | None) -> dict:
    geo = case.geo
    return {"name": case.name, "lengths": case.lengths if len(case.lengths) <= 8 else None, "bytes": case.bytes,
            "flops": case.flops, "rotations": case.rot, "calls_per_graph": case.calls, "peers": {},
            "peer_candidates": {},
            "config": resolve_config(cfg, geo.d, geo.dtype, geo.hkv, torch.device(geo.device)).__dict__}  # fmt: skip


def time_e4m3(entry: dict, case: Case, store: dict, cfg: SdpaConfig | None) -> None:
    """batchkv on the e4m3 `store` (codes `k`, `v` and their scales) beside the bf16 time in `entry`."""
    try:
        entry["max_abs_err_fp8"] = float(f"{case.error(batchkv_calls(case, **store, config=cfg)[0](), **store):.3g}")
        us, _ = time_calls(batchkv_calls(case, **store, config=cfg))
        fp8_bytes = case.bytes // case.geo.dtype.itemsize // case.geo.d * (case.geo.d + 4)  # codes and fp32 scales
        entry.update(batchkv_fp8_us=round(us, 2), gbps_fp8=round(fp8_bytes / us / 1e3, 1))
        if entry.get("batchkv_us"):
            entry["fp8_ratio"] = round(us / entry["batchkv_us"], 3)
    except Exception as exc:  # recorded, and the next case runs
        entry.update(batchkv_fp8_us=None, error_fp8=f"{type(exc).__name__}: {exc}"[:300])


def bench(
    cases: dict, k, v, cfg: SdpaConfig | None, report: dict, path: Path, deadline: Deadline, flex_s: float | None,
    peers: dict, e4m3: dict | None = None,
) -> dict:  # fmt: skip
    """batchkv (and, given `e4m3`, batchkv on that store) and every one of `peers` (name: candidates of a
    case) on every case, then flex with `flex_s` of the budget kept for it (None: no flex)."""
    peers_deadline = Deadline(deadline.left() - (flex_s or 0))
    entries = {e["name"]: e for e in report["cases"]}
    for name, case in cases.items():
        entry = entries.get(name) or new_entry(case, cfg)
        if name not in entries:
            report["cases"].append(entry)
            entries[name] = entry
        if entry.get("batchkv_us") is None:
            try:
                us, entry["timing"] = time_calls(batchkv_calls(case, k, v, cfg))
                r = rates(case, us, report)
                entry.update(batchkv_us=r.pop("us"), **r)
            except Exception as exc:
                entry.update(batchkv_us=None, timing=f"failed: {type(exc).__name__}: {exc}"[:300])
        if e4m3 is not None and entry.get("batchkv_fp8_us") is None:
            time_e4m3(entry, case, e4m3, cfg)
        for peer, build in peers.items():
            if entry["peers"].get(peer) is None:
                entry["peer_candidates"].pop(peer, None)
                run_peer(entry, peer, build(case, k, v), case, k, v, peers_deadline, report)
            write(path, report)
        if entry["peers"].get("flashinfer"):  # vLLM's default page size, beside the fastest
            entry["peers"]["flashinfer"]["page16_us"] = at_page(entry["peer_candidates"]["flashinfer"], 16)
        shown = {p: (b or {}).get("us") for p, b in entry["peers"].items()} or {"e4m3": entry.get("batchkv_fp8_us")}
        print(f"{name:15s} batchkv {entry['batchkv_us']} us {entry.get('gbps')} GB/s "
              f"{entry.get('pct_of_read')}% of read | {shown}", flush=True)  # fmt: skip
        write(path, report)
    if flex_s is None:
        return report
    torch._logging.set_logs(recompiles=True)
    order = [n for n in FLEX_FIRST if n in cases] + [n for n in cases if n not in FLEX_FIRST]
    for first_pass in (True, False):  # defaults for every case, then the other knobs while time lasts
        for name in order:
            entry, case = entries[name], cases[name]
            done = entry["peer_candidates"].get("flex", [])
            if first_pass and entry["peers"].get("flex") is not None:
                continue
            knobs = [o for o in knob_sets(case) if (not o) == first_pass
                     and all(r.get("config", {}).get("kernel_options") != o for r in done)]  # fmt: skip
            if not knobs:
                continue
            entry["peer_candidates"]["flex"] = done
            run_peer(entry, "flex", flex(case, k, v, knobs), case, k, v, deadline, report)
            write(path, report)
            best = entry["peers"].get("flex") or {}
            print(f"{name:15s} flex {best.get('us')} us {best.get('config', {}).get('path')} "
                  f"{best.get('config', {}).get('kernel_options')}", flush=True)  # fmt: skip
    torch._logging.set_logs(recompiles=False)
    return report


def header(geo, cfg: SdpaConfig | None, device: torch.device) -> dict:
    """Ceilings, versions, shapes and method: the report's fields that do not depend on a case."""
    import triton

    copy, copy_variants = copy_ceiling(device)
    read, read_variants = read_ceiling(device)
    shapes = {"Hq": geo.hq, "Hkv": geo.hkv, "D": geo.d, "dtype": str(geo.dtype).removeprefix("torch."),
              "columns": geo.columns, "rows": geo.rows, "seq_info_rows": geo.segments}  # fmt: skip
    return {"copy_gbps": copy, "copy_variants_gbps": copy_variants, "read_gbps": read,
            "read_variants_gbps": read_variants, "torch": torch.__version__, "triton": triton.__version__,
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "config": resolve_config(cfg, geo.d, geo.dtype, geo.hkv, device).__dict__, "shapes": shapes,
            "method": "median of CUDA-graph replays / calls per graph; calls rotate over `rotations` data copies; "
            f"peers: the fastest candidate within max abs error {TOLERANCE} of the torch reference",
            "varlen": varlen_api()[1]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results/kernels-h200.json"))
    parser.add_argument("--check", action="store_true", help="compare with the reference first")
    parser.add_argument("--compile-sm90", metavar="LABEL", default=None, help="compile the kernels for sm_90 without a "
                        "GPU and print registers, spills and the hot loop of each variant whose label contains LABEL "
                        "('' for all): bench/lib/compile_sm90.py")  # fmt: skip
    parser.add_argument("--e4m3", action="store_true", help="batchkv on bf16 and e4m3 stores, no peers (docstring)")
    parser.add_argument("--config", default="{}", help="SdpaConfig overrides as JSON, e.g. '{\"occupancy\": 4}'")
    parser.add_argument("--cases", default="", help="comma-separated case names (default: all)")
    parser.add_argument("--small", action="store_true", help="tiny geometry and cases (a CPU smoke run)")
    parser.add_argument("--budget-s", type=float, default=215.0, help="wall clock, after FlashInfer's compile")
    parser.add_argument("--flex-budget-s", type=float, default=110.0, help="part of the budget kept for flex")
    parser.add_argument("--resume", type=Path, default=None, help="a result JSON to complete")
    parser.add_argument("--flashinfer-compile-s", type=float, default=300.0,
                        help="FlashInfer's JIT compile, before the budget (0: leave FlashInfer out)")  # fmt: skip
    args = parser.parse_args()
    if args.compile_sm90 is not None:  # no GPU needed: Triton's NVIDIA backend compiles to cubins
        from bench.lib.compile_sm90 import main as compile_sm90

        compile_sm90(args.compile_sm90)
        return
    torch.manual_seed(0)
    names = args.cases.split(",") if args.cases else list(SMALL_CASES if args.small else CASES)
    cuda = torch.cuda.is_available()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size if cuda else 1 << 16
    geo, cases = build_cases(names, args.small, l2)
    k = torch.randn(geo.rows, geo.columns, geo.hkv, geo.d, device=geo.device, dtype=geo.dtype)
    v = torch.randn_like(k)
    overrides = json.loads(args.config)
    cfg = SdpaConfig(**overrides) if overrides else None
    report = json.loads(args.resume.read_text()) if args.resume else {"cases": []}
    e4m3, peers = None, {}
    if args.e4m3:
        (kc, ks), (vc, vs) = e4m3_store(k), e4m3_store(v)
        e4m3 = {"k": kc, "v": vc, "k_scale": ks, "v_scale": vs}
        report["config_e4m3"] = resolve_config(cfg, geo.d, kc.dtype, geo.hkv, k.device).__dict__
    else:
        fi, report["flashinfer"] = load_flashinfer(geo.dtype, geo.d, k.device, args.flashinfer_compile_s)
        peers = {"flashinfer": partial(flashinfer, fi, report["flashinfer"]), **PEERS}  # first: budget cuts the last
    deadline = Deadline(args.budget_s)
    if "read_gbps" not in report:
        report.update(header(geo, cfg, k.device))
    print(f"{report['device']}: copy {report['copy_gbps']:.0f} GB/s, read {report['read_gbps']:.0f} GB/s", flush=True)
    if args.check:
        check(cases, k, v, report.setdefault("check_max_abs_err", {}))
    started = time.perf_counter()
    bench(cases, k, v, cfg, report, args.out, deadline, None if args.e4m3 else args.flex_budget_s, peers, e4m3)
    report["wall_s"] = round(time.perf_counter() - started, 1)
    write(args.out, report)


if __name__ == "__main__":
    main()
