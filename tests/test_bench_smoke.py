"""The serving and e4m3 benchmarks run end to end at smoke sizes on the CPU and write what their
readers (bench/results, the README) take from them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(args: list[str], out: Path) -> dict:
    proc = subprocess.run([sys.executable, *args, "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(out.read_text())


def test_kernels_e4m3_smoke_times_decode_verify_and_prompt_chunks_on_both_stores_against_the_reference(tmp_path):
    args = ["bench/kernel_bench.py", "--small", "--e4m3", "--cases", "b4-mixed,b4-verify4,prefill-2x32"]
    report = _run(args, tmp_path / "kv.json")
    cases = {case["name"]: case for case in report["cases"]}
    assert set(cases) == {"b4-mixed", "b4-verify4", "prefill-2x32"}
    for case in cases.values():  # the split, verify and long paths
        assert case["max_abs_err_fp8"] < 1e-3 and case["batchkv_fp8_us"] > 0 and case["batchkv_us"] > 0
        assert case["peers"] == {}  # no peers beside the two stores


def test_decode_resumed_for_its_single_sequence_part_keeps_the_peers_entries(tmp_path):
    done = {"status": "done"}
    resume = tmp_path / "resume.json"
    resume.write_text(json.dumps({"parts": {"serve_batchkv": done, "online_batchkv": done},
                                  "b1": {"hf_static_compile_ms": 7.25}}))  # fmt: skip
    report = _run(["bench/decode.py", "--small", "--skip-hf", "--device", "cpu", "--resume", str(resume)],
                  tmp_path / "decode.json")  # fmt: skip
    assert report["parts"]["b1_batchkv"]["status"] == "done"
    assert report["b1"]["hf_static_compile_ms"] == 7.25 and report["b1"]["batchkv_eager_ms"] > 0


def test_prefix_smoke_reuses_the_shared_prefix_only_with_the_cache_on(tmp_path):
    report = _run(["bench/prefix.py", "--small"], tmp_path / "prefix.json")
    for workload in ("shared_prefix", "multi_turn", "no_sharing"):
        assert report[workload]["off"]["prefix_reused_tokens"] == 0 and report[workload]["on_over_off"] > 0
    on = report["shared_prefix"]["on"]
    assert on["prefix_reused_tokens"] == 5 * 64 and on["prefix_hit_rate"] > 0.8  # 5 of 6 reuse the 64-token prefix
    assert report["no_sharing"]["on"]["prefix_reused_tokens"] == 0  # random prompts share nothing
    assert len(report["multi_turn"]["on"]["ttft_p50_ms_by_turn"]) == 2


def test_decode_serve_limits_count_the_kv_bytes_the_engine_stores(tmp_path):
    skip = "b1_batchkv,online_batchkv,serve_fp8_batchkv,serve_fp8_e4m3_batchkv"
    report = _run(["bench/decode.py", "--small", "--skip-hf", "--device", "cpu", "--skip-parts", skip],
                  tmp_path / "decode.json")  # fmt: skip
    bf16, e4m3 = report["serve"]["workload_limit"], report["serve_e4m3"]["workload_limit"]
    assert e4m3["flops"] == bf16["flops"]  # the same requests
    # e4m3: one byte an element where the model's dtype has more, plus one fp32 scale per (position, head)
    assert 0.25 < e4m3["kv_read_bytes"] / bf16["kv_read_bytes"] < 0.75
    assert e4m3["no_overlap"] > bf16["no_overlap"]
