#!/usr/bin/env bash
# This session's call: GPU tests of RoPE in the K/V write; the SmolLM2 shape served with it on and off (twice
# each, alternating) and once with the whole step as prefill budget; on an H200 then TensorRT-LLM's 128/128
# (fp8 + e4m3 K/V, 30,000 requests, 5 steps profiled); a profiled SmolLM2 run with what is left.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
start=$SECONDS
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > $OUT/gpu.txt; cat $OUT/gpu.txt
timeout 70 python3 -m pytest -q -x tests/test_rope_write.py tests/test_kv_write.py tests/test_models_hf_kernels_gpu.py \
  > $OUT/gpu-tests.log 2>&1
echo "== gpu tests rc=$? at $((SECONDS-start))s"; tail -4 $OUT/gpu-tests.log | cut -c1-300
cp bench/probes_tmp/smol_trace.py bench/smol_trace.py
for tag in on1 off1 on2 off2 pb1; do
  left=$((${LIMIT:-540} - (SECONDS - start))); [ $left -lt 40 ] && break
  wr=1; pb=; case $tag in off*) wr=0;; pb*) pb=8192;; esac
  (OUT=$OUT/smol-$tag PB=$pb WRITE_ROPE=$wr PLAIN=1 MST=8192 timeout $((left > 150 ? 150 : left - 5)) python3 bench/smol_trace.py > $OUT/smol-$tag.log 2>&1)
  echo "== smol $tag at $((SECONDS-start))s"
  grep -E '"(write_rope|prefill_budget|step_p99_ms|warm_up_s|tokens_per_s_approx|steps|wall_s)"|Error' $OUT/smol-$tag.log | tr -d '\n '; echo
done
if grep -q H200 $OUT/gpu.txt; then
  left=$((${LIMIT:-540} - (SECONDS - start)))
  timeout $((left - 5)) python3 bench/anchors.py --out $OUT/anchors-128.json --workloads 128/128 --configs fp8_e4m3 \
    --budget-s $((left - 25)) --profile-steps 5 > $OUT/anchors-128.log 2>&1
  echo "== anchors at $((SECONDS-start))s"; tail -4 $OUT/anchors-128.log | cut -c1-300
  python3 -c "
import json; d = json.load(open('$OUT/anchors-128.json'))['workloads']['128/128']['fp8_e4m3']
print({k: v for k, v in d.items() if not isinstance(v, (dict, list))}); print(d.get('profile_ms_per_step'))" 2>&1 | cut -c1-900
fi
if ! grep -q H200 $OUT/gpu.txt; then  # the 8B Llama shape through HFModel, RoPE in the write on and off
  for wr in 1 0; do
    left=$((${LIMIT:-540} - (SECONDS - start))); [ $left -lt 150 ] && break
    timeout $((left > 200 ? 200 : left - 5)) python3 -c "
import runpy, sys, batchkv.models.hf_rope as h
h.WRITE_ROPE = bool($wr)
sys.argv = ['anchors.py', '--out', '$OUT/l8-wr$wr.json', '--workloads', '128/128', '--configs', 'bf16', '--requests', 'bf16=2048', '--budget-s', '170']
runpy.run_path('bench/anchors.py', run_name='__main__')" > $OUT/l8-wr$wr.log 2>&1
    echo "== l8 write_rope=$wr at $((SECONDS-start))s"
    python3 -c "
import json; d = json.load(open('$OUT/l8-wr$wr.json'))['workloads']['128/128']['bf16']
print({k: v for k, v in d.items() if not isinstance(v, (dict, list))})" 2>&1 | cut -c1-600
  done
fi
left=$((${LIMIT:-540} - (SECONDS - start)))
if [ $left -gt 60 ]; then
  (OUT=$OUT/smol-prof MST=8192 timeout $((left - 5)) python3 bench/smol_trace.py > $OUT/smol-prof.log 2>&1)
  echo "== smol prof at $((SECONDS-start))s"; grep -E '^(pre|full|mid|tail) ' $OUT/smol-prof.log | cut -c1-250
fi
rm -f bench/smol_trace.py
