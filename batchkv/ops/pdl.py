"""Programmatic dependent launch (PDL) for the Triton kernels of a decode step (NVIDIA sm_90+).

A kernel launched with `launch_pdl` may start while the grid before it in the stream still runs, as
soon as every program of that grid has called `griddepcontrol.launch_dependents` (or ended). So the
launch latency of the next kernel, small but paid ~500 times per decode step, overlaps work. Every
kernel here that opts in does the same thing (`pdl_enter`) before it touches memory a grid of the step
may write: it waits (`griddepcontrol.wait`) until every grid it depends on has finished and its writes
are visible, and only then lets its own dependents launch. Before the wait a kernel reads at most what
no grid of the step writes (the attention kernels and split_merge's merge plan from the step's
`seq_info` table, staged before the step's first kernel). That makes it correct whatever ran before it: a grid that
never triggers just lets it launch as it ends, and a plain launch (cuBLAS) after it starts after it
ends, as always. Captured graphs keep the programmatic edges. Elsewhere (CPU, the interpreter,
ROCm, older GPUs) `pdl_kwargs` turns it off and the kernels are unchanged.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchkv.ops.support import pdl_launch


def pdl_kwargs(device: torch.device, wanted: bool = True) -> dict:
    """Launch keywords of a kernel with a `GDC: tl.constexpr` parameter: PDL on where it is `wanted` and
    `device` has it, else a plain launch."""
    return {"GDC": True, "launch_pdl": True} if wanted and pdl_launch(device) else {"GDC": False}


@triton.jit
def pdl_enter(GDC: tl.constexpr):
    """In a kernel launched with `pdl_kwargs`, before anything a grid before it may have written is touched:
    wait for the grids before, then let the next launch."""
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
