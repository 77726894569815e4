"""The FP8 benchmarks run end to end at smoke sizes on the CPU and write what their readers take."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _run(args: list[str], out: Path, flag: str = "--out") -> dict:
    proc = subprocess.run([sys.executable, *args, flag, str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(out.read_text())


def test_anchors_smoke_reports_each_configuration_beside_its_limit(tmp_path):
    pytest.importorskip("transformers")
    report = _run(["bench/anchors.py", "--small", "--device", "cpu", "--budget-s", "400"], tmp_path / "a.json")
    assert report["read_gbps"] > 0 and report["fp8_tflops"] > 0
    for config in ("bf16", "fp8", "fp8_e4m3"):
        got = report["workloads"]["16/8"][config]
        assert got["requests"] == 4 and got["tokens_per_s"] > 0
        assert got["output_tokens"] == 4 * 8  # EOS ignored: every token asked for
        assert got["limit_tokens_per_s"]["overlap"] >= got["limit_tokens_per_s"]["serial"] > 0
    assert report["workloads"]["16/8"]["fp8_e4m3"]["kv_dtype"] == "torch.float8_e4m3fn"


def test_decode_fp8_parts_record_tokens_per_s_and_their_limit(tmp_path):
    skip = "b1_batchkv,serve_batchkv,online_batchkv,budgets_batchkv,serve_e4m3_batchkv,serve_max64_batchkv"
    report = _run(["bench/decode.py", "--small", "--skip-hf", "--device", "cpu", "--skip-parts", skip],
                  tmp_path / "d.json")  # fmt: skip
    for key in ("serve_fp8", "serve_fp8_e4m3"):
        assert report[key]["tokens_per_s"] > 0 and report[key]["quantization"] == "fp8"
        assert report[key]["workload_limit_tokens_per_s"]["overlap"] > 0
    assert report["serve_fp8_e4m3"]["kv_dtype"] == "torch.float8_e4m3fn"


def test_anchors_serve_stops_at_its_deadline_and_says_so():
    # A run past the call's budget keeps what it measured (a device call once lost two arms that timed out)
    from batchkv.executor import Engine
    from bench.anchors import serve
    from tests.toy_model import ToyModel

    class Steps:  # a deadline with `n` steps left
        def __init__(self, n: int) -> None:
            self.n = n

        def left(self) -> float:
            self.n -= 1
            return float(self.n >= 0)

    engine = Engine(ToyModel(seed=0), max_seqs=4, capacity=64, max_step_tokens=64)
    try:
        prompts, outputs = [[1, 2, 3], [4, 5], [6, 7, 8, 9]], [20, 20, 20]
        got = serve(engine, prompts, outputs, torch.device("cpu"), deadline=Steps(4))
        assert not got["finished"] and engine.has_work
        assert 0 < got["output_tokens"] < sum(outputs) and got["tokens_per_s"] > 0 and got["steps"] == 4
        done = serve(engine, prompts, outputs, torch.device("cpu"))  # no deadline: to the end
        assert done["finished"] and done["output_tokens"] >= sum(outputs)
    finally:
        engine.close()
