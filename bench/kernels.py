"""sdpa_varlen on SenseNova decode shapes: time, GB/s and % of the copy ceiling, beside its peers.

Shapes: Hq 32, Hkv 8, D 128, bf16, a 65-column store of 9216 rows (9100 positions fit), a 128-row
seq_info (the cache's default max_segments for 64 sequences), random distinct columns, seed 0.
Decode cases report GB/s of the valid K/V prefixes; prefill cases (chunks after histories, all
through the long kernel) also report TFLOP/s (4 * D * Hq per attended (query, key) pair).
Every time is the median over >= 100 CUDA-graph replays of a graph holding K back-to-back calls,
divided by K. Calls rotate over R copies of their data (other columns for batchkv, other gathered
buffers for the peers) so that a case smaller than the L2 cache is still read from HBM.
Peers, timed the same way where they capture: SDPA over each sequence's exact prefix (a loop over
prefixes gathered once outside timing), SDPA over a batch padded to its longest with a boolean
length mask, and compiled flex_attention with a length block mask. The SDPA peers fold the GQA
group into the query axis (q [B, Hkv, G*q_len, D]), the fastest honest way to hand GQA to SDPA.

    python3 bench/kernels.py [--check] [--sweep] [--out bench/results/kernels-h200.json]

--check first compares every case against the torch reference (a mismatch is recorded and
printed, not fatal); --sweep times a grid of SdpaConfig choices on SWEEP_CASES and writes
--sweep-out instead of the full benchmark. Results are written after every case and every sweep
row, and each case and config runs under its own try, so a failure midway loses nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from batchkv.ops import sdpa_varlen_reference
from batchkv.ops.sdpa_varlen_triton import SdpaConfig, resolve_config, sdpa_varlen

HQ, HKV, D, COLUMNS, ROWS, SEGMENTS = 32, 8, 128, 65, 9216, 128
G = HQ // HKV
DTYPE, DEV = torch.bfloat16, "cuda"
MIXED = (64, 8192)  # mixed cases draw lengths uniformly from this range
CASES = {  # name: (batch, q_len, kv_end of each sequence, or None for U[64, 8192])
    "b1-l1024": (1, 1, [1024]),
    "b1-l4096": (1, 1, [4096]),
    "b1-l9100": (1, 1, [9100]),
    "b8-mixed": (8, 1, None),
    "b32-mixed": (32, 1, None),
    "b64-mixed": (64, 1, None),
    "b32-verify4": (32, 4, None),
    "prefill-4x512": (4, 512, [1536] * 4),  # 512 new tokens after 1024-token histories
    "prefill-1x2048": (1, 2048, [2048]),
}
SWEEP_CASES = ("b1-l1024", "b1-l9100", "b8-mixed", "b64-mixed", "b32-verify4", "prefill-4x512")
SWEEP = [  # SdpaConfig overrides; the first is the default (heads 1 below 16 tokens, else 4)
    {},
    {"heads": 1},  # one KV head per program at every width (the previous layout)
    {"heads": 4},  # four at every width, b1 and b8 too
    {"heads": 8, "occupancy": 1},  # 2 KiB key rows, 8 warps, one 160 KiB program per SM
    {"heads": 2, "occupancy": 4},  # 2 warps per program
    {"min_blocks": 2},  # fewer partials for short totals (b1)
    {"occupancy": 1},
    {"occupancy": 3},  # registers capped at 168
    {"num_stages": 4},
    {"skip_masks": False},
    {"heads": 4, "merge_tile": 16384},  # 2x the partials per merge round trip
    {"block_m_long": 64, "num_warps_long": 4, "num_stages_long": 2},  # the previous prefill tiles
]


class Case:
    """One benchmark case: lengths, R rotated column sets and their seq_info tables, q."""

    def __init__(self, name: str, l2_bytes: int, gen: torch.Generator) -> None:
        batch, q_len, lengths = CASES[name]
        self.name, self.batch, self.q_len = name, batch, q_len
        self.lengths = lengths or torch.randint(MIXED[0], MIXED[1] + 1, (batch,), generator=gen).tolist()
        self.bytes = sum(self.lengths) * HKV * D * 2 * 2  # K and V of the valid prefixes
        # causal (query, key) pairs: query i of a segment attends kv_end - q_len + i + 1 keys
        pairs = sum(q_len * (n - q_len) + q_len * (q_len + 1) // 2 for n in self.lengths)
        self.flops = 4 * D * HQ * pairs
        self.rot = min(64, max(1, math.ceil(4 * l2_bytes / self.bytes)))
        est_us = max(self.bytes / 3e6, self.flops / 3e8) + 5
        self.calls = max(self.rot, min(64, math.ceil(200 / est_us)))
        perm = torch.randperm(64, generator=gen).tolist()  # rotation j takes the next `batch` columns
        self.cols = [[perm[(j * batch + b) % 64] for b in range(batch)] for j in range(self.rot)]
        self.tables = [self._table(cols) for cols in self.cols]
        self.q = torch.randn(batch * q_len, HQ, D, generator=gen).to(DEV, DTYPE)

    def _table(self, cols: list[int]) -> torch.Tensor:
        info = torch.zeros(SEGMENTS, 4, dtype=torch.int32)
        for b, (col, kv_end) in enumerate(zip(cols, self.lengths, strict=True)):
            info[b] = torch.tensor([b * self.q_len, self.q_len, col, kv_end])
        return info.to(DEV)


# ---- timing --------------------------------------------------------------------------------------
def capture(fn):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def median_us(run, replays: int) -> float:
    run()
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
    for start, end in pairs:
        start.record()
        run()
        end.record()
    torch.cuda.synchronize()
    return 1000 * statistics.median(s.elapsed_time(e) for s, e in pairs)


def time_calls(calls: list, replays: int = 100) -> tuple[float, str]:
    """Median µs per call of `calls` run back to back: graph replay, or CUDA events if capture fails."""

    def run_all():
        for call in calls:
            call()

    try:
        graph = capture(run_all)
        return median_us(graph.replay, replays) / len(calls), "graph"
    except Exception as exc:  # a peer that cannot be captured is timed eagerly, and says so
        torch.cuda.synchronize()
        return median_us(run_all, replays) / len(calls), f"events ({type(exc).__name__})"


COPY_VARIANTS: dict[str, float] = {}


def copy_gbps() -> float:
    """Device-to-device copy ceiling, bytes read + written per second / 1e9: the best of a memcpy of
    1 and 4 GiB and an elementwise copy kernel (`mul(src, 1, out=dst)`), each a median of replays."""
    for gib in (1, 4):
        src = torch.empty(gib << 29, dtype=torch.bfloat16, device=DEV).normal_()
        dst = torch.empty_like(src)
        us, _ = time_calls([lambda src=src, dst=dst: dst.copy_(src)], replays=20)
        COPY_VARIANTS[f"copy_{gib}gib"] = round(2 * (gib << 30) / us / 1e3, 1)
        if gib == 4:
            us, _ = time_calls([lambda src=src, dst=dst: torch.mul(src, 1, out=dst)], replays=20)
            COPY_VARIANTS["elementwise_4gib"] = round(2 * (gib << 30) / us / 1e3, 1)
        del src, dst
    return max(COPY_VARIANTS.values())


# ---- batchkv and its peers ----------------------------------------------------------------------
def batchkv_calls(case: Case, k, v, config: SdpaConfig | None):
    out = torch.empty_like(case.q)
    tables = case.tables
    return [
        lambda j=j: sdpa_varlen(case.q, k, v, tables[j % case.rot], out=out, config=config) for j in range(case.calls)
    ]


def fold(q_seq: torch.Tensor) -> torch.Tensor:
    """[q_len, Hq, D] -> [Hkv, G*q_len, D], row g*q_len + i (the GQA group on the query axis)."""
    q_len = q_seq.shape[0]
    return q_seq.view(q_len, HKV, G, D).permute(1, 2, 0, 3).reshape(HKV, G * q_len, D)


def unfold(o: torch.Tensor, q_len: int) -> torch.Tensor:
    return o.reshape(HKV, G, q_len, D).permute(2, 0, 1, 3).reshape(q_len, HQ, D)


def causal_rows(q_len: int, length: int, width: int) -> torch.Tensor:
    """Boolean [G*q_len, width]: row g*q_len + i sees keys t <= length - q_len + i."""
    i = torch.arange(G * q_len, device=DEV) % q_len
    return torch.arange(width, device=DEV)[None, :] <= (length - q_len + i)[:, None]


def gather(k, col, length, width=None):
    """[Hkv, width, D] copy of one column's first `length` keys (zero padded to width)."""
    width = width or length
    buf = torch.zeros(HKV, width, D, dtype=DTYPE, device=DEV)
    buf[:, :length] = k[:length, col].permute(1, 0, 2)
    return buf


def exact_loop(case: Case, k, v):
    """SDPA per sequence over its exact prefix; returns (calls, output of rotation 0).

    A chunk without history (kv_end == q_len > 1) is plain causal attention: it gets SDPA's
    is_causal with enable_gqa (the flash path) instead of a mask."""
    plain = case.q_len > 1 and all(n == case.q_len for n in case.lengths)
    rots = []
    for cols in case.cols:
        seqs = []
        for b, (col, n) in enumerate(zip(cols, case.lengths, strict=True)):
            q_seq = case.q[b * case.q_len : (b + 1) * case.q_len]
            q_b = q_seq.transpose(0, 1)[None] if plain else fold(q_seq)[None]
            mask = None if case.q_len == 1 or plain else causal_rows(case.q_len, n, n)
            seqs.append((q_b, gather(k, col, n)[None], gather(v, col, n)[None], mask))
        rots.append(seqs)

    def call(j):
        if plain:
            return [F.scaled_dot_product_attention(q, kk, vv, is_causal=True, enable_gqa=True)
                    for q, kk, vv, _ in rots[j % case.rot]]  # fmt: skip
        return [F.scaled_dot_product_attention(q, kk, vv, attn_mask=m) for q, kk, vv, m in rots[j % case.rot]]

    def output():
        if plain:
            return torch.cat([o[0].transpose(0, 1) for o in call(0)])
        return torch.cat([unfold(o[0], case.q_len) for o in call(0)])

    return [lambda j=j: call(j) for j in range(case.calls)], output


def padded_inputs(case: Case, k, v, multiple: int):
    width = -(-max(case.lengths) // multiple) * multiple
    rots = []
    for cols in case.cols:
        kk = torch.stack([gather(k, c, n, width) for c, n in zip(cols, case.lengths, strict=True)])
        vv = torch.stack([gather(v, c, n, width) for c, n in zip(cols, case.lengths, strict=True)])
        rots.append((kk, vv))
    return width, rots


def padded_mask(case: Case, k, v):
    width, rots = padded_inputs(case, k, v, 64)
    q = torch.stack([fold(case.q[b * case.q_len : (b + 1) * case.q_len]) for b in range(case.batch)])
    mask = torch.stack([causal_rows(case.q_len, n, width) for n in case.lengths])[:, None]  # [B, 1, G*q, W]

    def call(j):
        return F.scaled_dot_product_attention(q, *rots[j % case.rot], attn_mask=mask)

    return [lambda j=j: call(j) for j in range(case.calls)], lambda: torch.cat([unfold(o, case.q_len) for o in call(0)])


_flex_compiled = None


def flex(case: Case, k, v):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    width, rots = padded_inputs(case, k, v, 128)
    q = case.q.view(case.batch, case.q_len, HQ, D).transpose(1, 2).contiguous()  # [B, Hq, q_len, D]
    lens = torch.tensor(case.lengths, device=DEV)
    q_len = case.q_len

    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx <= lens[b] - q_len + q_idx

    block_mask = create_block_mask(mask_mod, case.batch, None, q_len, width, device=DEV)
    global _flex_compiled
    if _flex_compiled is None:
        for knob in ("cache_size_limit", "recompile_limit"):  # one compile per case shape
            if hasattr(torch._dynamo.config, knob):
                setattr(torch._dynamo.config, knob, 64)
        _flex_compiled = torch.compile(flex_attention)
    compiled = _flex_compiled

    def call(j):
        return compiled(q, *rots[j % case.rot], block_mask=block_mask, enable_gqa=True)

    return [lambda j=j: call(j) for j in range(case.calls)], lambda: call(0).transpose(1, 2).reshape(-1, HQ, D)


PEERS = {"sdpa_exact_loop_us": exact_loop, "sdpa_padded_mask_us": padded_mask, "flex_us": flex}


# ---- modes --------------------------------------------------------------------------------------
def write(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")


def reference(case: Case, k, v) -> torch.Tensor:
    return sdpa_varlen_reference(case.q, k, v, case.tables[0]).float()


def check(cases: dict, k, v, report: dict) -> None:
    """batchkv against the reference on rotation 0 of every case (max abs error; peers: in bench).

    A mismatch or a failure is recorded and printed loudly, and the benchmark goes on."""
    for name, case in cases.items():
        try:
            err = (batchkv_calls(case, k, v, None)[0]().float() - reference(case, k, v)).abs().max().item()
            report[name] = err
            verdict = "ok" if err < 3e-2 else "MISMATCH: batchkv disagrees with the reference"
            print(f"check {name}: batchkv max abs error {err:.2e} vs the torch reference: {verdict}")
        except Exception as exc:
            report[name] = f"failed: {type(exc).__name__}: {exc}"[:300]
            print(f"check {name}: FAILED {report[name]}")


def sweep(cases: dict, k, v, ceiling: float, path: Path) -> None:
    names = [n for n in SWEEP_CASES if n in cases]
    refs = {n: reference(cases[n], k, v) for n in names}
    results = []
    for overrides in SWEEP:
        row = {"config": overrides, "us": {}, "pct_of_copy": {}, "tflops": {}, "errors": {}}
        for n in names:
            case = cases[n]
            try:
                calls = batchkv_calls(case, k, v, SdpaConfig(**overrides))
                err = (calls[0]() - refs[n]).abs().max().item()
                if not err < 3e-2:
                    raise RuntimeError(f"max error {err} against the reference")
                us, _ = time_calls(calls)
                row["us"][n] = round(us, 2)
                row["pct_of_copy"][n] = round(100 * case.bytes / us / 1e3 / ceiling, 1)
                row["tflops"][n] = round(case.flops / us / 1e6, 1)
            except Exception as exc:
                row["errors"][n] = f"{type(exc).__name__}: {exc}"[:300]
                torch.cuda.synchronize()
        results.append(row)
        base = results[0]["us"]
        ratio = [base[n] / row["us"][n] for n in names if n in row["us"] and n in base]
        row["speedup_vs_default"] = round(math.prod(ratio) ** (1 / len(ratio)), 3) if ratio else None
        print(f"{json.dumps(overrides):58s} " + " ".join(f"{row['us'].get(n, float('nan')):9.2f}" for n in names)
              + f"  x{row['speedup_vs_default']}" + (f"  {row['errors']}" if row["errors"] else ""))  # fmt: skip
        write(path, {"copy_gbps": ceiling, "cases": names, "results": results})
    ranked = sorted((r for r in results if r.get("speedup_vs_default")), key=lambda r: -r["speedup_vs_default"])
    write(path, {"copy_gbps": ceiling, "cases": names, "results": results, "best": ranked[0] if ranked else None})
    print("best:", json.dumps(ranked[0]) if ranked else None)


def bench(cases: dict, k, v, ceiling: float, cfg: SdpaConfig | None, path: Path, flex_budget_s: float) -> dict:
    import triton

    resolved = resolve_config(cfg, D, DTYPE, HKV, torch.device(DEV))
    report = {
        "copy_gbps": round(ceiling, 1),
        "copy_variants_gbps": COPY_VARIANTS,
        "cases": [],
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "config": resolved.__dict__,
        "shapes": {
            "Hq": HQ,
            "Hkv": HKV,
            "D": D,
            "dtype": "bfloat16",
            "columns": COLUMNS,
            "rows": ROWS,
            "seq_info_rows": SEGMENTS,
        },
        "method": "median of 100 CUDA-graph replays / calls per graph; calls rotate over `rotations` data copies",
    }
    for name, case in cases.items():
        entry = {"name": name, "peers": {}, "peer_timing": {}, "bytes": case.bytes, "flops": case.flops,
                 "rotations": case.rot, "calls_per_graph": case.calls,
                 "config": resolve_config(cfg, D, DTYPE, HKV, torch.device(DEV)).__dict__}  # fmt: skip
        report["cases"].append(entry)
        try:
            us, entry["timing"] = time_calls(batchkv_calls(case, k, v, cfg))
            gbps = case.bytes / us / 1e3
            entry.update(batchkv_us=round(us, 2), gbps=round(gbps, 1), pct_of_copy=round(100 * gbps / ceiling, 1),
                         tflops=round(case.flops / us / 1e6, 1))  # fmt: skip
        except Exception as exc:
            entry.update(batchkv_us=None, gbps=None, pct_of_copy=None, tflops=None)
            entry["timing"] = f"failed: {type(exc).__name__}: {exc}"[:300]
            torch.cuda.synchronize()
        for peer in ("sdpa_exact_loop_us", "sdpa_padded_mask_us"):
            run_peer(entry, peer, case, k, v)
        write(path, report)
        print(f"{name:14s} batchkv {entry['batchkv_us']} us {entry['gbps']} GB/s {entry['pct_of_copy']}% "
              f"{entry['tflops']} TFLOP/s | {entry['peers']}")  # fmt: skip
    started = time.time()
    for entry in report["cases"]:  # flex last: its compiles are the slow part
        if time.time() - started > flex_budget_s:
            entry["peers"]["flex_us"] = None
            entry["peer_timing"]["flex_us"] = f"skipped: flex budget of {flex_budget_s:.0f} s spent"
        else:
            run_peer(entry, "flex_us", cases[entry["name"]], k, v)
        write(path, report)
        print(f"{entry['name']:12s} flex {entry['peers']['flex_us']} ({entry['peer_timing']['flex_us']})")
    return report


def run_peer(entry: dict, peer: str, case: Case, k, v) -> None:
    """Time one peer into `entry`, and record its max abs error against the reference."""
    try:
        calls, output = PEERS[peer](case, k, v)
        us, how = time_calls(calls)
        entry["peers"][peer], entry["peer_timing"][peer] = round(us, 2), how
        err = (output().float() - reference(case, k, v)).abs().max().item()
        entry.setdefault("peer_max_abs_err", {})[peer] = float(f"{err:.3g}")
    except Exception as exc:
        entry["peers"][peer], entry["peer_timing"][peer] = None, f"failed: {type(exc).__name__}: {exc}"[:300]
    torch.cuda.empty_cache()


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [c["name"] for c in report["cases"]]
    series = {"batchkv": [c.get("batchkv_us") or float("nan") for c in report["cases"]]}
    for peer in PEERS:
        series[peer.removesuffix("_us")] = [c["peers"].get(peer) or float("nan") for c in report["cases"]]
    fig, ax = plt.subplots(figsize=(13, 5))
    width = 0.8 / len(series)
    for i, (label, values) in enumerate(series.items()):
        bars = ax.bar([x + i * width for x in range(len(names))], values, width, label=label)
        if label == "batchkv":
            for bar, case in zip(bars, report["cases"], strict=True):
                if case.get("pct_of_copy") is None:
                    continue
                prefill = case["name"].startswith("prefill")
                text = f"{case['tflops']:.0f} TF/s" if prefill else f"{case['pct_of_copy']:.0f}%"
                ax.annotate(text, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                            fontsize=8)  # fmt: skip
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(names))], names)
    ax.set_yscale("log")
    ax.set_ylabel("µs per call (graph replay; lower is better)")
    ax.set_title(
        f"sdpa_varlen, Hq 32 / Hkv 8 / D 128 bf16 — {report['device']}; % = of copy {report['copy_gbps']:.0f} GB/s"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results/kernels-h200.json"))
    parser.add_argument("--sweep-out", type=Path, default=Path("bench/results/kernels-sweep.json"))
    parser.add_argument("--check", action="store_true", help="compare with the reference first")
    parser.add_argument("--sweep", action="store_true", help="time a grid of SdpaConfig instead of the benchmark")
    parser.add_argument("--config", default="{}", help="SdpaConfig overrides as JSON, e.g. '{\"occupancy\": 4}'")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated case names")
    parser.add_argument("--flex-budget-s", type=float, default=240.0, help="stop timing flex after this long")
    args = parser.parse_args()
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(ROWS, COLUMNS, HKV, D, device=DEV, dtype=DTYPE)
    v = torch.randn_like(k)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    cases = {n: Case(n, l2, gen) for n in args.cases.split(",")}
    ceiling = copy_gbps()
    print(f"{torch.cuda.get_device_name()}: copy {ceiling:.0f} GB/s, L2 {l2 / 2**20:.0f} MiB")
    checks: dict = {}
    if args.check:
        check(cases, k, v, checks)
    if args.sweep:
        sweep(cases, k, v, ceiling, args.sweep_out)
        return
    overrides = json.loads(args.config)
    report = bench(cases, k, v, ceiling, SdpaConfig(**overrides) if overrides else None, args.out, args.flex_budget_s)
    report["check_max_abs_err"] = checks
    write(args.out, report)
    try:
        plot(report, args.out.with_suffix(".png"))
    except Exception as exc:
        print(f"plot skipped: {type(exc).__name__}: {exc}")


if __name__ == "__main__":
    main()
