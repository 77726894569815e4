#!/usr/bin/env bash
# Device call 1: GPU tests of the paths changed since the last GPU run (short steps, PDL split/long), then
# the SmolLM2 A/B: base 71a6a5c vs HEAD with pdl off vs HEAD (PLAIN=1 MST=8192), ROUNDS rounds.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
start=$SECONDS
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
python3 -c 'import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)'
T=${TESTS_LIMIT:-260}
g1="tests/test_engine_gpu.py tests/test_graphs_gpu.py tests/test_overlap_gpu.py tests/test_executor_rows_gpu.py"
g2="tests/test_speculative_gpu.py tests/test_logprobs_gpu.py tests/test_serve_gpu.py tests/test_fp8_qk_long.py tests/test_softcap_sinks_gpu.py"
g3="tests/test_sdpa_varlen_gpu.py tests/test_sdpa_varlen_splitkv.py tests/test_sdpa_varlen_variants.py tests/test_sdpa_varlen_write.py tests/test_models_hf_fuse.py tests/test_compat_gpu.py tests/test_value_dim_gpu.py"
i=0
for g in "$g1" "$g2" "$g3"; do
  i=$((i+1))
  timeout $T python3 -m pytest -m gpu $g -q --tb=short -p no:cacheprovider -ra -x --timeout 200 > "$OUT/tests$i.log" 2>&1 &
done
wait
for i in 1 2 3; do echo "== tests$i"; grep -E "passed|failed|error|FAILED|ERROR|Timeout" "$OUT/tests$i.log" | tail -8; done
echo "tests done at $((SECONDS-start))s"
[ "${SKIP_AB:-0}" = 1 ] && exit 0
# trees: base 71a6a5c (before short steps), head 01b631e (short steps + split/long PDL), this (the walk + zero runs)
run_one() {  # name tree [env...]
  local name=$1 tree=$2; shift 2
  (cd "$tree" && env "$@" OUT=$OUT/ab-$name PLAIN=1 MST=8192 PYTHONPATH=/tmp/site:$tree timeout 150 python3 bench/smol_trace.py > "$OUT/ab-$name.log" 2>&1)
  echo "== $name at $((SECONDS-start))s"; grep -E '"(warm_up_s|captures_after_warm_up|captures_end|tokens_per_s_approx)"|Error' "$OUT/ab-$name.log" | head -6
}
cp .whl/smol_trace.py bench/smol_trace.py
for r in $(seq ${ROUNDS:-1}); do
  run_one base-$r $PWD/.whl/base
  run_one nopdl-$r $PWD/.whl/head SDPA='{"pdl": false}'
  run_one head-$r $PWD/.whl/head
  run_one this-$r $PWD
done
rm -f bench/smol_trace.py
