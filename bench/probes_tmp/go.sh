#!/usr/bin/env bash
# H200: the SmolLM2 shape served at HEAD (twice), with the whole step as prefill budget, with 64-key tiles in the
# split kernel (SdpaConfig block_n 64), both; the split kernel at SmolLM2's attention over tiles; GPU sdpa tests.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
start=$SECONDS
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/gpu.txt; cat $OUT/gpu.txt
git log --oneline -1
cp .whl/smol_trace.py bench/smol_trace.py; cp .whl/attn_probe.py bench/attn_probe.py
for tag in head1 bn1 pb1 bnpb1 head2; do
  left=$((${LIMIT:-540} - (SECONDS - start))); [ $left -lt 50 ] && break
  pb=; sd=; case $tag in pb*|bnpb*) pb=8192;; esac; case $tag in bn*) sd='{"block_n": 64}';; esac
  (OUT=$OUT/smol-$tag PB=$pb SDPA=$sd PLAIN=1 MST=8192 timeout $((left > 150 ? 150 : left - 5)) python3 bench/smol_trace.py > $OUT/smol-$tag.log 2>&1)
  echo "== smol $tag at $((SECONDS-start))s"
  grep -E '"(prefill_budget|step_p99_ms|warm_up_s|tokens_per_s_approx|steps|wall_s)"|Error' $OUT/smol-$tag.log | tr -d '\n '; echo
  if [ $tag = head1 ]; then
    left=$((${LIMIT:-540} - (SECONDS - start)))
    CONFIGS='[null, {"block_n": 64}, {"block_n": 64, "num_stages": 3}]' OUT=$OUT TAG=smol \
      timeout $((left > 75 ? 75 : left - 5)) python3 bench/attn_probe.py smol-b16 smol-b64 smol-b150 smol-b256 smol-S > $OUT/attn.log 2>&1
    echo "== attn at $((SECONDS-start))s"; grep -v '^ ' $OUT/attn.log | sed -E "s/, 'us_min.*//" | cut -c1-120
  fi
done
left=$((${LIMIT:-540} - (SECONDS - start)))
[ $left -gt 60 ] && timeout $((left - 3)) python3 -m pytest -q -x tests/test_rope_write.py tests/test_models_hf_kernels_gpu.py > $OUT/gpu-tests.log 2>&1
echo "== gpu tests rc=$? at $((SECONDS-start))s"; tail -2 $OUT/gpu-tests.log | cut -c1-300
rm -f bench/smol_trace.py bench/attn_probe.py
