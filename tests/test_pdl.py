"""Programmatic dependent launch (`batchkv/ops/pdl.py`) is off wherever the device lacks it; the
kernels that opt in then run as before (their interpreter suites here). The GPU tests run every
step kernel with it on (graphs, engine, model and kernel suites)."""

from __future__ import annotations

import torch

from batchkv.ops.pdl import pdl_kwargs
from batchkv.ops.support import pdl_launch


def test_cpu_devices_launch_without_pdl():
    assert not pdl_launch(torch.device("cpu"))
    assert pdl_kwargs(torch.device("cpu")) == {"GDC": False}  # no launch_pdl keyword for the interpreter
