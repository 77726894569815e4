#!/usr/bin/env bash
# Device call 2: attention probe head (01b631e) vs this, a SmolLM2 config sweep on this tree, SmolLM2 served
# (this, head), a second probe round, the engine's warm-up GPU test.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
ROOT=$PWD
start=$SECONDS
probe() {  # tag tree [names...]
  local tag=$1 tree=$2; shift 2
  (cd $tree && TAG=$tag OUT=$OUT PYTHONPATH=/tmp/site:$tree timeout ${PROBE_LIMIT:-100} python3 $ROOT/.whl/attn_probe.py "$@" > $OUT/probe-$tag.log 2>&1)
  echo "== probe $tag at $((SECONDS-start))s"; cut -c1-170 $OUT/probe-$tag.log | tail -14
}
probe head-1 $ROOT/.whl/head
probe this-1 $ROOT
CONFIGS='[null, {"block_n": 64}, {"num_stages": 3}, {"min_blocks": 4}, {"occupancy": 6}, {"occupancy": 8, "block_n": 64}, {"num_warps": 4, "occupancy": 2, "num_stages": 3}]' \
  probe sweep $ROOT smol-b150 smol-b256 smol-b64
cp .whl/smol_trace.py bench/smol_trace.py
run_one() {  # name tree [env...]
  local name=$1 tree=$2; shift 2
  (cd "$tree" && env "$@" OUT=$OUT/ab-$name PLAIN=1 MST=8192 PYTHONPATH=/tmp/site:$tree timeout 150 python3 bench/smol_trace.py > "$OUT/ab-$name.log" 2>&1)
  echo "== $name at $((SECONDS-start))s"; grep -E '"(warm_up_s|captures_after_warm_up|tokens_per_s_approx)"|Error' "$OUT/ab-$name.log" | head -6
}
run_one this-2 $ROOT
run_one head-2 $ROOT/.whl/head
rm -f bench/smol_trace.py
probe head-2 $ROOT/.whl/head
probe this-2 $ROOT
python3 - "$OUT" <<'PY'
import json, sys, glob
runs = {p.split("attn-")[1][:-5]: json.load(open(p))["cases"] for p in sorted(glob.glob(sys.argv[1] + "/attn-*.json")) if "sweep" not in p}
names = sorted({n for r in runs.values() for n in r})
for n in names:
    h = [runs[k][n].get("us") for k in runs if k.startswith("head") and n in runs[k]]
    t = [runs[k][n].get("us") for k in runs if k.startswith("this") and n in runs[k]]
    ok = h and t and None not in h + t
    print(f"{n:24s} head {h} this {t} this/head {sum(t) / len(t) / (sum(h) / len(h)):.3f}" if ok else n)
PY
CONFIGS='[null, {"block_n_long": 64}, {"block_n_long": 64, "num_stages_long": 3}, {"block_n_long": 64, "block_m_long": 128, "num_warps_long": 8}]' \
  probe sweep-long $ROOT l8-prefill-4x1024-e4m3
timeout 120 python3 -m pytest -m gpu tests/test_engine_gpu.py -q --tb=short -p no:cacheprovider -k "warm_up" --timeout 110 > $OUT/tests-engine.log 2>&1
echo "== engine gpu tests at $((SECONDS-start))s"; tail -3 $OUT/tests-engine.log
