#!/usr/bin/env bash
# On the H200: GPU tests, the reference check and config sweep, then the full kernel benchmark.
# Everything lands under $OUT (default /tmp/out); a short table prints last. About 6-8 minutes.
#   OUT=/tmp/out bash bench/run_gpu.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
start=$SECONDS
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())'

echo "== gpu tests"
python3 -m pytest -m gpu tests/test_sdpa_varlen_gpu.py -q -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tests.log"
echo "   ($((SECONDS - start)) s)"

echo "== check + sweep"
python3 bench/kernels.py --check --sweep --sweep-out "$OUT/kernels-sweep.json" 2>&1 | tee "$OUT/sweep.log"
echo "   ($((SECONDS - start)) s)"

echo "== benchmark"
python3 bench/kernels.py --check --out "$OUT/kernels-h200.json" --flex-budget-s 200 2>&1 | tee "$OUT/bench.log"
echo "   ($((SECONDS - start)) s)"

python3 - "$OUT/kernels-h200.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
print(f"\ncopy ceiling {r['copy_gbps']:.0f} GB/s on {r['device']}")
print(f"{'case':12s} {'batchkv us':>10s} {'GB/s':>7s} {'%copy':>6s} {'exact':>9s} {'padded':>9s} {'flex':>9s}")
for c in r["cases"]:
    p = c["peers"]
    f = lambda x: f"{x:9.1f}" if isinstance(x, (int, float)) else f"{'-':>9s}"
    print(f"{c['name']:12s} {c['batchkv_us']:10.2f} {c['gbps']:7.0f} {c['pct_of_copy']:6.1f} "
          f"{f(p.get('sdpa_exact_loop_us'))} {f(p.get('sdpa_padded_mask_us'))} {f(p.get('flex_us'))}")
PY
