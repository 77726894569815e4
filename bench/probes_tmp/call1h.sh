#!/usr/bin/env bash
# Call 1 on an H100 (no anchors: TensorRT-LLM's numbers are H200's): attention probe 01b631e vs HEAD; TensorRT-LLM's 128/128 at 30,000 requests (fp8 + e4m3 K/V) on HEAD;
# SmolLM2 served by HEAD with what time is left.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
ROOT=$PWD
start=$SECONDS
CASES1="smol-b150 smol1h-b150 smol-b64 smol-b256 l8-d1024-short-e4m3 l8-mixed-e4m3 l8-d256-std-e4m3"
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/gpu.txt
probe() {  # tag tree [names...]
  local tag=$1 tree=$2; shift 2
  (cd $tree && TAG=$tag OUT=$OUT PYTHONPATH=/tmp/site:$tree timeout ${PROBE_LIMIT:-90} python3 $ROOT/.whl/attn_probe.py "$@" > $OUT/probe-$tag.log 2>&1)
  echo "== probe $tag at $((SECONDS-start))s"; cut -c1-150 $OUT/probe-$tag.log | tail -18
}
probe head-1 $ROOT/.whl/head $CASES1
probe this-1 $ROOT $CASES1
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
left=$((590 - (SECONDS - start)))
if [ $left -gt 115 ]; then
  cp .whl/smol_trace.py bench/smol_trace.py
  (OUT=$OUT/smol-this PLAIN=1 MST=8192 timeout $((left > 153 ? 150 : left - 3)) python3 bench/smol_trace.py > $OUT/smol-this.log 2>&1)
  echo "== smol this at $((SECONDS-start))s"; grep -E '"(warm_up_s|captures_after_warm_up|tokens_per_s_approx|steps|wall_s)"|Error' $OUT/smol-this.log | head -8
  left=$((590 - (SECONDS - start)))
  (cd .whl/head && OUT=$OUT/smol-head PLAIN=1 MST=8192 PYTHONPATH=/tmp/site:$ROOT/.whl/head timeout $((left - 3)) python3 bench/smol_trace.py > $OUT/smol-head.log 2>&1)
  echo "== smol head at $((SECONDS-start))s"; grep -E '"(warm_up_s|captures_after_warm_up|tokens_per_s_approx|steps|wall_s)"|Error' $OUT/smol-head.log | head -8
  rm -f bench/smol_trace.py
fi
