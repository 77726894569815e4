"""Programmatic dependent launch (`batchkv/ops/pdl.py`) is off wherever the device lacks it; the
kernels that opt in then run as before (their interpreter suites here). The GPU tests run every
step kernel with it on (graphs, engine, model and kernel suites)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton

from batchkv.ops.pdl import pdl_kwargs
from batchkv.ops.sdpa import launch
from batchkv.ops.sdpa.launch import SdpaConfig
from batchkv.ops.support import pdl_launch
from tests.test_sdpa_varlen import check

ROOT = Path(__file__).resolve().parents[1]
NVIDIA = Path(triton.__file__).parent / "backends" / "nvidia"


def test_cpu_devices_launch_without_pdl():
    assert not pdl_launch(torch.device("cpu"))
    assert pdl_kwargs(torch.device("cpu")) == {"GDC": False}  # no launch_pdl keyword for the interpreter


@pytest.mark.parametrize("pdl", [True, False])
def test_the_split_and_long_kernels_ask_for_pdl_unless_the_config_turns_it_off(monkeypatch, pdl):
    # a step with decode, verify and prompt-chunk segments launches both kernels; each asks the device
    # helper for its launch keywords with the config's wish (on the CPU the answer is a plain launch)
    asked = []

    def recording(device, wanted=True):
        asked.append(wanted)
        return pdl_kwargs(device, wanted)

    monkeypatch.setattr(launch, "pdl_kwargs", recording)
    check([(1, 0, 40), (5, 1, 30), (24, 2, 24), (1, 3, 7)], rows=48, config=SdpaConfig(pdl=pdl, block_n=16))
    assert asked == [pdl, pdl]  # the split kernel, then the long kernel


@pytest.mark.skipif(not (NVIDIA / "bin" / "ptxas").exists(), reason="this Triton has no NVIDIA backend")
def test_the_attention_kernels_wait_for_the_grids_before_ahead_of_reading_q_or_kv_or_writing(tmp_path):
    # compiled for sm_90 as launched there (GDC on): the plan's table loads come before griddepcontrol.wait,
    # every store, atomic and K/V copy after it, so an early start reads nothing a grid before may write
    grab = (
        "import sys, triton, bench.lib.compile_sm90 as c\n"
        "compile = triton.compile\n"
        "def keep(*a, **k):\n"
        "    r = compile(*a, **k)\n"
        "    open(sys.argv[1] + '/' + r.name + '.ptx', 'w').write(r.asm['ptx'])\n"
        "    return r\n"
        "c.triton.compile = keep\n"
        "c.split(); c.split(store='fp8e4nv', block_n=128); c.long()\n"
    )  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile, do not interpret
    proc = subprocess.run([sys.executable, "-c", grab, str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0 and "FAILED" not in proc.stdout, proc.stdout + proc.stderr[-2000:]
    for name in ("split_kernel", "long_kernel"):
        ptx = (tmp_path / f"{name}.ptx").read_text()
        code = [line.split("//")[0].strip() for line in ptx[ptx.index(f".entry {name}") :].splitlines()]
        ops = [re.sub(r"^@!?%p\d+\s+", "", line) for line in code if line and not line.startswith(".")]
        waits = [i for i, op in enumerate(ops) if op.startswith("griddepcontrol.wait")]
        assert len(waits) == 1 and any(op.startswith("griddepcontrol.launch_dependents") for op in ops[waits[0] :])
        wait = waits[0]
        assert any(op.startswith("ld.global") for op in ops[:wait]), name  # the table, read early
        touches = ("st.global", "atom.", "red.", "cp.async")  # stores, the merge counters, K/V copies
        assert not [op for op in ops[:wait] if op.startswith(touches)], name
        assert [op for op in ops[wait:] if op.startswith("st.global")], name  # the output, after the wait
