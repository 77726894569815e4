"""bench/tp.py's --small smoke run: TP=1 and TP=2 over gloo on the CPU, every part, the issue's keys."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_tp_bench_small_writes_every_key_its_gpu_run_reports(tmp_path):
    out = tmp_path / "tp.json"
    proc = subprocess.run([sys.executable, "bench/tp.py", "--small", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert {name: part["status"] for name, part in r["parts"].items()} == dict.fromkeys(
        ("ceilings", "b1", "serve", "llama70b"), "done"
    )
    assert r["b1"]["tp1_ms"] > 0 and r["b1"]["tp2_ms"] > 0
    assert r["b1"]["greedy_bf16"] == {"equal": True, "first_divergence": None, "tokens": 16}  # fp32 here
    assert r["serve"]["tp1_tokens_per_s"] > 0 and r["serve"]["tp2_tokens_per_s"] > 0
    assert all(r["llama70b"][k] > 0 for k in ("tp2_ms", "roofline_ms", "tp2_tokens_per_s"))
    assert r["allreduce_busbw_gbps"] > 0 and r["copy_gbps"] > 0
    assert r["allreduce_per_step_b1"]["8b"]["all_reduces"] == 2 * 4 + 1  # two per layer and the embedding
