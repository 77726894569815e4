"""Print the tables the README's "Measured on an H200" section is stated from, and plot decode.

python3 bench/summary.py "$OUT"      # reads kernels-h200.json and decode-h200.json there
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _num(value, fmt: str = "9.1f") -> str:
    return format(value, fmt) if isinstance(value, (int, float)) else f"{'-':>9s}"


def kernels(path: Path) -> None:
    r = json.loads(path.read_text())
    ceilings = f"copy {r['copy_gbps']:.0f} GB/s, read {r['read_gbps']:.0f} GB/s"
    print(f"\nkernels on {r['device']}: {ceilings} (torch {r['torch']})")
    peers = ("sdpa_exact", "sdpa_padded_mask", "varlen", "flex")
    print(f"{'case':15s} {'batchkv':>9s} {'%read':>6s} " + " ".join(f"{p[:12]:>12s}" for p in peers))
    for c in r["cases"]:
        row = f"{c['name']:15s} {_num(c.get('batchkv_us'))} {_num(c.get('pct_of_read'), '6.1f')} "
        row += " ".join(f"{_num((c['peers'].get(p) or {}).get('us'), '12.1f')}" for p in peers)
        print(row)
    for c in r["cases"]:
        configs = {p: {k: v for k, v in (b or {}).get("config", {}).items() if k not in ("kernels", "max_abs_err")}
                   for p, b in c["peers"].items()}  # fmt: skip
        print(f"  {c['name']}: {json.dumps(configs)}")


def decode(path: Path) -> None:
    r = json.loads(path.read_text())
    b1, s = r.get("b1", {}), r.get("serve", {})
    print(f"\ndecode on {r.get('device')}: read {_num(r.get('read_gbps'), '.0f')} GB/s, "
          f"GEMM {_num(r.get('matmul_tflops'), '.0f')} TFLOP/s; parts {json.dumps(r.get('parts'))}")  # fmt: skip
    print(
        "b1 ms/token:",
        {k: round(v, 3) for k, v in b1.items() if k.endswith("_ms")},
        "roofline",
        r.get("roofline_ms_b1"),
    )
    keys = ("tokens_per_s", "fair_roofline_tokens_per_s", "bytes_only_roofline_tokens_per_s", "hf_cb_tokens_per_s",
            "batchkv_on_hf_prefix_tokens_per_s")  # fmt: skip
    print("serve:", {k: round(s[k]) for k in keys if isinstance(s.get(k), (int, float))})
    if s.get("hf_cb"):
        hf = s["hf_cb"]
        print(f"  hf_cb {hf['setting']} on {hf['requests_measured']} requests: finished {hf['finished']}, "
              f"boxed {hf['boxed']}")  # fmt: skip
    if s.get("hf_fallback"):
        print(
            "  hf fallback:", {k: v for k, v in s["hf_fallback"].items() if k != "why"}, s["hf_fallback"]["why"][:300]
        )
    for row in s.get("online", []):
        peer = row.get("peer") or {}
        ttft = f"{_num(row['ttft_p50_ms'], '.0f')}/{_num(row['ttft_p99_ms'], '.0f')}"
        print(f"  online {row['label']:16s} {row['rate']:5.2f} req/s n={row['requests']:3d} | batchkv "
              f"{row['tokens_per_s']:6.0f} tok/s TTFT {ttft} "
              f"ITL {_num(row['itl_p50_ms'], '.1f')}/{_num(row['itl_p99_ms'], '.1f')} ms | transformers "
              f"{_num(peer.get('tokens_per_s'), '.0f')} tok/s TTFT {_num(peer.get('ttft_p50_ms'), '.0f')}/"
              f"{_num(peer.get('ttft_p99_ms'), '.0f')} ITL {_num(peer.get('itl_p50_ms'), '.1f')}/"
              f"{_num(peer.get('itl_p99_ms'), '.1f')} kept_up {peer.get('kept_up')} "
              f"finished {peer.get('finished')}")  # fmt: skip


def main(out: str) -> None:
    folder = Path(out)
    for name, show in (("kernels-h200.json", kernels), ("decode-h200.json", decode)):
        if (folder / name).exists():
            try:
                show(folder / name)
            except Exception as exc:  # a partial file prints what it can
                print(f"{name}: {type(exc).__name__}: {exc}")
    if (folder / "decode-h200.json").exists():
        try:
            from plot_decode import main as plot

            plot(str(folder / "decode-h200.json"))
        except Exception as exc:
            print(f"decode plot skipped: {type(exc).__name__}: {exc}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bench/results")
