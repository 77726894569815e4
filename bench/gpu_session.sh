#!/usr/bin/env bash
# One call on the GPU machine: the named phases in order, each under its own time limit, results under $OUT. Phases:
# oomtests tests kernels model decode fp8 spec tp tptests tp1ab (the other results' probes are in git history, as
# bench/results/README.md says), e.g. `OUT=/tmp/out bash bench/gpu_session.sh tests decode`. tp and tptests need two
# GPUs (nvidia-h200-x2): bench/tp.py (resumed across calls with TP_ARGS="--resume bench/results/tp-h200x2.json") and
# tests/test_tp_gpu.py. tp1ab, on one GPU: bench/decode.py's one-sequence decode and serving parts from a baseline tree
# (BASE, default .base: `git archive <commit> | tar -x -C .base`, carried) and from this one, alternately (AB_ROUNDS
# rounds), then each ratio this/base (the single-GPU path must stay within 3%). kernels, fp8 (bench/kernel_bench.py
# --e4m3) and decode carry wall-clock budgets (--budget-s) under their limits, write JSON after every part and finish
# with what fit; a stopped run is completed later by passing its JSON back, e.g. DECODE_ARGS="--resume
# bench/results/decode-h200.json". The machine has no msgspec: carry its wheel in .whl/ (bash
# ../shared/device/wheels.sh). A carried .fi/ (the pruned FlashInfer) adds the kernels phase's flashinfer peer; its JIT
# compile (~95 s) precedes the phase's --budget-s: raise KERNELS_LIMIT with it (bench/results/README.md).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
if [ -d .fi/pkg ]; then  # the pruned FlashInfer, the kernels phase's flashinfer peer (bench/results/README.md)
  python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/fi_site .fi/wheels/*.whl &&
    export PYTHONPATH=$PWD/.fi/pkg:/tmp/fi_site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
start=$SECONDS
phase() {  # name, limit in seconds, command...
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit}s, at $((SECONDS - start))s)"
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log" | grep -v '^USDT' | tail -n 40
  echo "== $name done: rc ${PIPESTATUS[0]} at $((SECONDS - start))s"
}
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__, torch.cuda.get_device_name())'
for p in "$@"; do
  case $p in
    oomtests) phase oomtests 120 python3 -m pytest -m gpu tests/test_refusals_gpu.py -v --tb=short -p no:cacheprovider ;;
    tests) phase tests "${TESTS_LIMIT:-300}" python3 -m pytest -m gpu ${TESTS_PATHS:-tests} -v --tb=short -p no:cacheprovider -ra \
      --timeout 150 ${TESTS_ARGS:-} ;;
    kernels) phase kernels "${KERNELS_LIMIT:-240}" python3 bench/kernel_bench.py --check --out "$OUT/kernels-h200.json" \
      --budget-s "${KERNELS_BUDGET:-215}" ${KERNELS_ARGS:-} ;;
    model) phase model 90 python3 bench/model_step.py --preset sensenova-u1-8b --rows 1 8 32 64 --json "$OUT/model_step.json" ;;
    decode) phase decode "${DECODE_LIMIT:-420}" python3 bench/decode.py --out "$OUT/decode-h200.json" \
      --budget-s "${DECODE_BUDGET:-390}" ${DECODE_ARGS:-} ;;
    fp8) phase fp8 "${FP8_LIMIT:-240}" python3 bench/kernel_bench.py --e4m3 --out "$OUT/kv-fp8-h200.json" \
      --budget-s "${FP8_BUDGET:-215}" ${FP8_ARGS:-} ;;
    spec) phase spec "${SPEC_LIMIT:-240}" python3 bench/spec.py --out "$OUT/spec-h200.json" \
      --budget-s "${SPEC_BUDGET:-150}" ${SPEC_ARGS:-} ;;
    tp) phase tp "${TP_LIMIT:-590}" python3 bench/tp.py --out "$OUT/tp-h200x2.json" --budget-s "${TP_BUDGET:-560}" \
      ${TP_ARGS:-} ;;
    tptests) phase tptests 300 python3 -m pytest -m gpu tests/test_tp_gpu.py -v --tb=short -p no:cacheprovider -ra \
      --timeout 150 ;;
    tp1ab) rest=${PYTHONPATH#"$PWD"}  # the wheels' paths, after this tree's
      for round in $(seq "${AB_ROUNDS:-1}"); do
        for tree in "${BASE:-.base}" .; do
          name=$([ "$tree" = . ] && echo this || echo base)
          root=$(cd "$tree" && pwd)
          (cd "$root" && export PYTHONPATH=$root$rest && phase "ab-$name-$round" 280 python3 bench/decode.py \
            --out "$OUT/ab-$name-$round.json" --skip-hf --budget-s 250 ${AB_ARGS:-} \
            --skip-parts online_batchkv,serve_e4m3_batchkv,serve_fp8_batchkv,serve_fp8_e4m3_batchkv)
        done
      done
      python3 - "$OUT" <<'PY'
import json, pathlib, sys
runs = {p.stem: json.loads(p.read_text()) for p in sorted(pathlib.Path(sys.argv[1]).glob("ab-*.json"))}
b1 = lambda r: r["b1"].get("batchkv_graph_ms", r["b1"].get("batchkv_eager_ms"))  # eager: a CPU trial
for key, get in (("b1 ms/token", b1), ("serve tok/s", lambda r: r["serve"]["tokens_per_s"])):
    base = [get(r) for n, r in runs.items() if n.startswith("ab-base")]
    this = [get(r) for n, r in runs.items() if n.startswith("ab-this")]
    print(key, "base", base, "this", this, "this/base", sum(this) / len(this) / (sum(base) / len(base)))
PY
      ;;
    *) echo "unknown phase $p" ;;
  esac
done
echo "== all done at $((SECONDS - start))s"
