#!/usr/bin/env bash
# Call 2: sdpa GPU tests on HEAD, the smol config sweep, a profiled SmolLM2 run.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
ROOT=$PWD
LIMIT=${LIMIT:-590}
start=$SECONDS
timeout 120 python3 -m pytest -m gpu tests/test_sdpa_varlen_gpu.py tests/test_sdpa_varlen_splitkv.py tests/test_sdpa_varlen_write.py tests/test_sdpa_varlen_variants.py -q --tb=short -p no:cacheprovider > $OUT/tests-sdpa.log 2>&1
echo "== sdpa gpu tests at $((SECONDS-start))s"; tail -4 $OUT/tests-sdpa.log
probe() {  # tag tree [names...]
  local tag=$1 tree=$2; shift 2
  (cd $tree && TAG=$tag OUT=$OUT PYTHONPATH=/tmp/site:$tree timeout ${PROBE_LIMIT:-90} python3 $ROOT/.whl/attn_probe.py "$@" > $OUT/probe-$tag.log 2>&1)
  echo "== probe $tag at $((SECONDS-start))s"; cut -c1-150 $OUT/probe-$tag.log | tail -18
}
left=$((LIMIT - (SECONDS - start) - 150))
CONFIGS='[null, {"prefetch": 1}, {"prefetch": 2}, {"block_n": 64}, {"occupancy": 6}, {"min_blocks": 4}, {"num_stages": 3}, {"occupancy": 2, "num_warps": 4}]' \
  PROBE_LIMIT=$((left > 10 ? left : 10)) probe sweep $ROOT smol-b150 smol1h-b150
left=$((LIMIT - (SECONDS - start)))
if [ $left -gt 120 ]; then
  cp .whl/smol_trace.py bench/smol_trace.py
  (OUT=$OUT/smol-prof MST=8192 timeout $left python3 bench/smol_trace.py > $OUT/smol-prof.log 2>&1)
  echo "== smol profile at $((SECONDS-start))s"; tail -c 1500 $OUT/smol-prof.log
  rm -f bench/smol_trace.py
fi
