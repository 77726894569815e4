#!/usr/bin/env bash
# #38 on the H200 (or any GPU): the SmolLM2 shape served at HEAD (block_n 128, table_chunk 0) against 64-key
# tiles (bn*), 1ddb2a5's tree (old*: before 0e65905 moved the whole-table plan before the PDL wait), 64-key tiles
# with the live-row plan (bnc*), the live-row plan alone (c512*, c256), the whole step as prefill budget (pb512);
# then the attention probe (PROF=1: the split and long kernels timed apart) with what is left, Nsight Compute on
# the split kernel at 256 and 150 decodes (block_n 128 and 64), GPU tests of the live-row plan.
# Usage (from the repo root, after bash ../shared/device/wheels.sh and git archive 1ddb2a5 batchkv bench pyproject.toml
# > .whl/old.tar, the base tree of the old* runs): LIMIT=480 bash .whl/go.sh, carry [".whl"];
# RESERVE=s keeps s seconds for the tests, PROBE_S for the probe, TAGS the served runs, ATTN_S the probe's limit.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
start=$SECONDS
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/gpu.txt; cat $OUT/gpu.txt
mkdir -p /tmp/old && tar -xf .whl/old.tar -C /tmp/old && cp .whl/smol_trace.py /tmp/old/bench/smol_trace.py  # 1ddb2a5's tree (old*)
cp .whl/smol_trace.py bench/smol_trace.py; cp .whl/attn_probe.py bench/attn_probe.py
left() { echo $((${LIMIT:-540} - (SECONDS - start))); }
for tag in ${TAGS:-head1 bn1 old1 head2 bn2 old2 bnc1}; do
  l=$(( $(left) - ${RESERVE:-0} - ${PROBE_S:-60} )); [ $l -lt 50 ] && break
  pb=; sd=; case $tag in pb*) pb=8192;; esac
  case $tag in c256) sd='{"table_chunk": 256}';; bnc*) sd='{"table_chunk": 512, "block_n": 64}';;
    bn*) sd='{"block_n": 64}';; c512*|pb512) sd='{"table_chunk": 512}';; esac
  dir=$PWD; case $tag in old*) dir=/tmp/old;; esac
  (cd $dir && PYTHONPATH=/tmp/site:$dir OUT=$OUT/smol-$tag PB=$pb SDPA=$sd PLAIN=1 MST=8192 timeout $((l > 150 ? 150 : l - 5)) python3 bench/smol_trace.py > $OUT/smol-$tag.log 2>&1)
  rm -rf $OUT/smol-$tag  # (its trace.json: the machine returns few files; the log holds the summary)
  echo "== smol $tag at $((SECONDS-start))s"
  grep -E '"(prefill_budget|step_p99_ms|warm_up_s|tokens_per_s_approx|steps|wall_s)"|Error' $OUT/smol-$tag.log | tr -d '\n '; echo
done
[ $(( $(left) - ${RESERVE:-0} )) -gt 30 ] && { CONFIGS='[null, {"table_chunk": 512}, {"block_n": 64}]' LIVE='[true]' PROF=1 OUT=$OUT TAG=live timeout $(( $(left) - ${RESERVE:-0} < ${ATTN_S:-90} ? $(left) - ${RESERVE:-0} : ${ATTN_S:-90} )) \
  python3 bench/attn_probe.py smol-b256 smol-b150 smol-b256-mixed4096 smol-b150-mixed \
  l8-d1024-short > $OUT/attn.log 2>&1
echo "== attn at $((SECONDS-start))s"; grep -v '^ ' $OUT/attn.log | sed -E "s/'us_min'[^}]*'S': [0-9]+, //" | cut -c1-230; }
l=$(( $(left) - 45 ))
[ $l -gt 30 ] && (CONFIGS='[null, {"block_n": 64}]' LIVE='[true]' NCU=1 OUT=$OUT TAG=ncu timeout $((l > 90 ? 90 : l)) \
  ncu --clock-control none --profile-from-start off --kernel-name regex:split_kernel --section SpeedOfLight \
  --section Occupancy --section WarpStateStats --section LaunchStats --section MemoryWorkloadAnalysis \
  python3 bench/attn_probe.py smol-b256 smol-b150 > $OUT/ncu.log 2>&1; echo "== ncu rc=$? at $((SECONDS-start))s")
l=$(left)
[ $l -gt 40 ] && timeout $((l - 3)) python3 -m pytest -q -x tests/test_sdpa_varlen_live.py tests/test_cache_triton.py tests/test_rope_write.py > $OUT/gpu-tests.log 2>&1
echo "== gpu tests rc=$? at $((SECONDS-start))s"; tail -2 $OUT/gpu-tests.log | cut -c1-300
rm -f bench/smol_trace.py bench/attn_probe.py
