"""Plot bench/results/decode-h200.json: ms/token at one sequence and serving tokens/s, with rooflines.

python bench/plot_decode.py bench/results/decode-h200.json   # writes decode-h200.png beside it
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r = json.loads(Path(path).read_text())
    b1, serve = r["b1"], r["serve"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    names = ["batchkv_graph_ms", "hf_static_compile_ms", "batchkv_eager_ms", "hf_eager_ms"]
    labels = ["batchkv\ngraphs", "transformers\nStatic+compile", "batchkv\neager", "transformers\neager"]
    values = [b1.get(n) or 0 for n in names]
    left.bar(labels, values, color=["C0", "C1", "C0", "C1"])
    left.axhline(r["roofline_ms_b1"], color="k", ls="--", label=f"weight-read roofline {r['roofline_ms_b1']:.2f} ms")
    left.set_yscale("log")
    left.set_ylabel("ms per token (log)")
    left.set_title(f"one sequence: prompt {b1['prompt']}, {b1['new_tokens']} new tokens")
    for x, v in enumerate(values):
        left.text(x, v, f"{v:.2f}", ha="center", va="bottom")
    left.legend()
    bars = [serve["tokens_per_s"], serve.get("hf_eager_tokens_per_s") or 0]
    right.bar(["batchkv\n(64 seqs, graphs)", "transformers generate\n(padded batch of 64)"], bars, color=["C0", "C1"])
    right.axhline(serve["roofline_tokens_per_s"], color="k", ls="--", label="roofline (weights + KV bytes)")
    right.set_ylabel("output tokens/s")
    right.set_title(f"serving {serve['requests']} requests")
    for x, v in enumerate(bars):
        right.text(x, v, f"{v:.0f}", ha="center", va="bottom")
    right.legend()
    fig.suptitle(f"SenseNova-U1-8B shape, random bf16 weights, {r['device']}")
    fig.tight_layout()
    out = Path(path).with_suffix(".png")
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "bench/results/decode-h200.json")
