"""The e4m3 attention kernels and the K/V write compile for sm_90 (no GPU needed): the interpreter,
which runs the CPU tests, checks no Triton shape rule, so a tile the GPU compiler refuses passes
every CPU test.

Runs `bench/kernel_bench.py --compile-sm90` (bench/lib/compile_sm90.py) on its head_dim 16 e4m3 variants,
where each dot over a half-width (D / 2 = 8) pair tile would contract fewer than the 16 columns tl.dot
takes on NVIDIA GPUs.
"""

from __future__ import annotations

import os
import re
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
    proc = subprocess.run([sys.executable, "bench/kernel_bench.py", "--compile-sm90", "'D': 16"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("split e4m3/", "long e4m3/"))]
    assert sum(line.startswith("split") for line in lines) == 4 and len(lines) == 5, proc.stdout
    assert not [line for line in lines if "FAILED" in line], proc.stdout


@pytest.mark.skipif(not (NVIDIA / "bin" / "ptxas").exists(), reason="this Triton has no NVIDIA backend")
def test_the_e4m3_qk_long_variant_dots_k_codes_straight_from_shared_memory(tmp_path):
    # SdpaConfig.e4m3_qk_long: in each of the three key loops the QK dot's B operand is the pipelined
    # e4m3 K buffer itself (a memdesc), and V is the only tile converted (one f8 -> f16 per loop)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TTGIR_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "bench/kernel_bench.py", "--compile-sm90", "'qk_e4m3': True}"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0 and "FAILED" not in proc.stdout, proc.stdout + proc.stderr[-2000:]
    (ir,) = [p.read_text() for p in tmp_path.glob("long_e4m3*qk_e4m3*.ttgir")]
    fp8_dots = re.findall(r"warp_group_dot .*xf8E4M3FN.* \* !ttg\.memdesc<[0-9x]+xf8E4M3FN", ir)
    converted = re.findall(r"tt\.fp_to_fp .*xf8E4M3FN, #\w+> -> tensor<[0-9x]+xf16", ir)
    assert len(fp8_dots) == 3 and len(converted) == 3, (len(fp8_dots), len(converted))


@pytest.mark.skipif(not (NVIDIA / "bin" / "ptxas").exists(), reason="this Triton has no NVIDIA backend")
def test_the_kv_write_kernel_compiles_for_sm90_with_its_nonfinite_row_handling_and_rope():
    # the NaN scale and 0x7F codes of a row holding a NaN or an infinity are plain Triton ops (a bitcast
    # of the e4m3 codes to uint8 and back): the interpreter takes ops the GPU compiler may refuse
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "bench/kernel_bench.py", "--compile-sm90", "kv_write"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    lines = [line for line in proc.stdout.splitlines() if line.startswith("kv_write")]
    assert proc.returncode == 0 and len(lines) == 5, proc.stdout + proc.stderr[-2000:]  # two with RoPE
    assert not [line for line in lines if "FAILED" in line], proc.stdout
