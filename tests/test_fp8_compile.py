"""The e4m3 attention kernels compile for sm_90 (no GPU needed): the interpreter, which runs the CPU
tests, checks no Triton shape rule, so a tile the GPU compiler refuses passes every CPU test.

Runs `bench/compile_sm90.py` on its head_dim 16 e4m3 variants, where each dot over a half-width
(D / 2 = 8) pair tile would contract fewer than the 16 columns tl.dot takes on NVIDIA GPUs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

ROOT = Path(__file__).resolve().parents[1]
NVIDIA = Path(triton.__file__).parent / "backends" / "nvidia"


@pytest.mark.skipif(not (NVIDIA / "bin" / "ptxas").exists(), reason="this Triton has no NVIDIA backend")
def test_the_e4m3_kernels_compile_for_sm90_at_head_dim_16():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile, do not interpret
    proc = subprocess.run([sys.executable, "bench/compile_sm90.py", "'D': 16"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("split e4m3/", "long e4m3/"))]
    assert sum(line.startswith("split") for line in lines) == 4 and len(lines) == 5, proc.stdout
    assert not [line for line in lines if "FAILED" in line], proc.stdout
