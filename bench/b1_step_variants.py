"""One-sequence decode of the 8B model (prompt 512, 256 tokens, CUDA graphs) with its linear layers routed several ways.

- `default`: `linear` as shipped (the few-row kernel for every projection, the down projection
  after `silu_mul`);
- `down_cublas`: the down projection through cuBLAS (the previous route), the rest as shipped;
- `cublas_all`: every projection through cuBLAS;
- `gemv_json_best`: as shipped, with `TUNED` replaced by the one-row winners in
  bench/results/gemv-h200.json (`--gemv-json`), to check the shipped tiles in the step itself.

Each times `decode.single_sequence` (ms/token, median inter-token time of the second of two
identical requests) on one model, back to back in one process; `default` runs again last to show the
drift between runs.

    python3 bench/b1_step_variants.py --out /tmp/out/b1-step-variants-h200.json     # on the GPU, ~40 s
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from decode import single_sequence

import batchkv.models.gemv as gemv_module
import batchkv.models.sensenova as sensenova
from batchkv.models import build_model
from batchkv.models.fused import silu_mul as silu_mul_rows

SHIPPED = sensenova.linear


def json_best(path: Path) -> dict:
    """(N, K) -> (block_n, block_k, num_stages) of each shape's one-row winner in a bench/gemv.py JSON."""
    shapes = json.loads(path.read_text())["shapes"]
    best = {(v["n"], v["k"]): v["rows"]["1"]["best"]["config"] for v in shapes.values()}
    return {nk: (c["block_n"], c["block_k"], c["num_stages"]) for nk, c in best.items()}


def down_cublas(x, w, *, silu_mul=False, out_dtype=None):
    if silu_mul:
        return F.linear(silu_mul_rows(x), w)
    return SHIPPED(x, w, out_dtype=out_dtype)


def cublas_all(x, w, *, silu_mul=False, out_dtype=None):
    y = F.linear(silu_mul_rows(x) if silu_mul else x, w)
    return y if out_dtype is None else y.to(out_dtype)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--gemv-json", type=Path, default=Path(__file__).parent / "results" / "gemv-h200.json")
    args = ap.parse_args()
    shipped_tuned = dict(gemv_module.TUNED)
    tuned = {"gemv_json_best": json_best(args.gemv_json)}
    dev = torch.device("cuda")
    model = build_model("sensenova-u1-8b", dev, seed=0)
    variants = [("default", SHIPPED), ("down_cublas", down_cublas), ("cublas_all", cublas_all),
                ("gemv_json_best", SHIPPED), ("default_again", SHIPPED)]  # fmt: skip
    report: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "method": __doc__.splitlines()[0], "gemv_json_best": {f"{n}x{k}": v for (n, k), v in
                    tuned["gemv_json_best"].items()}, "ms_per_token": {}}  # fmt: skip
    try:
        for name, linear in variants:
            sensenova.linear = linear
            gemv_module.TUNED = tuned.get(name, shipped_tuned)
            ms = single_sequence(model, dev, 512, 256, graphs=True)["ms_per_token_p50"]
            report["ms_per_token"][name] = round(ms, 4)
            print(f"{name:16s} {ms:.3f} ms/token", flush=True)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=1) + "\n")
    finally:
        sensenova.linear, gemv_module.TUNED = SHIPPED, shipped_tuned


if __name__ == "__main__":
    main()
