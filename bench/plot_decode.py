"""Plot a bench/decode.py result: one sequence ms/token, offline serving tokens/s with both rooflines,
and online serving (TTFT and inter-token p50/p99 per arrival rate), batchkv beside transformers.

python bench/plot_decode.py bench/results/decode-h200.json   # writes decode-h200.png beside it
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _bars(ax, labels, values, colors) -> None:
    ax.bar(labels, [v or 0 for v in values], color=colors)
    for x, v in enumerate(values):
        ax.text(x, v or 0, "n/a" if v is None else f"{v:.3g}", ha="center", va="bottom", fontsize=8)


def main(path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r = json.loads(Path(path).read_text())
    b1, serve = r.get("b1", {}), r.get("serve", {})
    fig, (one, offline, online) = plt.subplots(1, 3, figsize=(17, 4.8))
    names = ["batchkv_graph_ms", "hf_static_compile_ms", "batchkv_eager_ms", "hf_eager_ms"]
    labels = ["batchkv\ngraphs", "transformers\nStatic+compile", "batchkv\neager", "transformers\neager"]
    _bars(one, labels, [b1.get(n) for n in names], ["C0", "C1", "C0", "C1"])
    if r.get("roofline_ms_b1"):
        one.axhline(r["roofline_ms_b1"], color="k", ls="--", label=f"roofline {r['roofline_ms_b1']:.2f} ms")
        one.legend(fontsize=8)
    one.set_yscale("log")
    one.set_ylabel("ms per token (log)")
    one.set_title(f"one sequence: prompt {b1.get('prompt')}, {b1.get('new_tokens')} new tokens", fontsize=10)

    hf = serve.get("hf_cb") or {}
    fallback = serve.get("hf_fallback") or {}
    prefix = hf.get("requests_measured")
    labels = [f"batchkv\n{serve.get('requests')} requests", f"transformers CB\nfirst {prefix}",
              f"batchkv\nfirst {prefix}"]  # fmt: skip
    values = [
        serve.get("tokens_per_s"),
        serve.get("hf_cb_tokens_per_s"),
        serve.get("batchkv_on_hf_prefix_tokens_per_s"),
    ]
    if fallback:
        labels[1], values[1] = "transformers\nStatic+compile b64", fallback.get("tokens_per_s")
    _bars(offline, labels, values, ["C0", "C1", "C0"])
    for key, style, text in (("fair_roofline_tokens_per_s", "--", "fair roofline"),
                             ("bytes_only_roofline_tokens_per_s", ":", "bytes-only roofline")):  # fmt: skip
        if serve.get(key):
            offline.axhline(serve[key], color="k", ls=style, label=f"{text} {serve[key]:.0f}")
    offline.set_yscale("log")
    offline.set_ylabel("output tokens/s (log)")
    offline.set_title("offline serving, at most 64 sequences", fontsize=10)
    offline.legend(fontsize=8)

    rows = serve.get("online", [])
    for i, row in enumerate(rows):
        peer = row.get("peer") or {}
        for dx, who, color, src in ((-0.2, "batchkv", "C0", row), (0.2, "transformers", "C1", peer)):
            for key, marker in (("ttft_p50_ms", "o"), ("ttft_p99_ms", "^"), ("itl_p50_ms", "s"), ("itl_p99_ms", "v")):
                if src.get(key):
                    online.scatter(i + dx, src[key], color=color, marker=marker,
                                   label=f"{who} {key[:-3]}" if i == 0 else None)  # fmt: skip
        if peer and not peer.get("kept_up", True):
            online.text(i + 0.2, online.get_ylim()[0], "did not\nkeep up", ha="center", va="bottom", fontsize=7)
    online.set_xticks(range(len(rows)), [f"{row['label']}\n{row['rate']:.2f} req/s" for row in rows])
    online.set_yscale("log")
    online.set_ylabel("ms (log)")
    online.set_title("online: Poisson arrivals; TTFT from arrival", fontsize=10)
    online.legend(fontsize=7, ncol=2)
    fig.suptitle(f"SenseNova-U1-8B shape, random bf16 weights, {r.get('device')}")
    fig.tight_layout()
    out = Path(path).with_suffix(".png")
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bench/results/decode-h200.json")
