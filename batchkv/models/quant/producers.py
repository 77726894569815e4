"""Activations quantised by the kernels that produce them (NVIDIA sm_89+), for `Fp8Linear` inputs.

Where a model already runs a kernel over an activation that only an `Fp8Linear` reads, that kernel
also writes the e4m3 codes and per-row scales (`Fp8Rows`), instead of a bf16 row that the layer's
separate quantiser (`batchkv.models.quant.fp8.quantize_rows`, one program per row) reads again:

- `add_rms_norm_quant`: `batchkv.models.fused.add_rms_norm` quantising its normed row in the same
  launch (the norm before q/k/v and gate/up; `add_rms_norm_for` picks it by the reader), and
  `rms_norm_quant` the same for transformers' norms (`batchkv.models.hf_norms`), with or without the
  residual add, storing the normed rows as well: both are `fused.py`'s norm kernel with its quantiser on;
- `silu_mul_quant`: SiLU-mul over row chunks (before down; `silu_mul_linear` picks it by the
  reader), so that every SM streams even at few rows, with each row's amax gathered by an int32
  atomic max of the float bits (|x| >= 0 orders as its bits, and a NaN's bits exceed every number's,
  so a NaN anywhere makes the row's scale NaN), then the codes.

Both give the separate passes' codes and scales bit for bit (the same roundings: the norm's and
SiLU-mul's outputs are rounded to the model dtype before the amax), and fall back to those passes
off CUDA or with `FUSED_QUANT` off. On the H200 (8B step, 256 rows; bench/results/fp8-gemm-ab-h200.json)
the add-RMSNorm with the quantiser took 0.31 ms a step against 0.21 + 0.24 for the norm and the
separate quantiser.
"""

from __future__ import annotations

import torch
from torch import nn

from batchkv.models.fused import add_rms_norm, norm_kernel_ok, norm_launch, norm_out_dtype, rms_norm
from batchkv.models.fused import silu_mul as silu_mul_rows
from batchkv.models.gemv import linear
from batchkv.models.quant import fp8 as fp8_module
from batchkv.models.quant.fp8 import (
    E4M3,
    INV_E4M3_MAX,
    MIN_ACT_SCALE,
    Fp8Linear,
    Fp8Rows,
    quantize_rows,
)
from batchkv.ops.support import fp8_gemm

try:
    import triton
    import triton.language as tl

    from batchkv.ops.pdl import pdl_enter, pdl_kwargs
except ImportError:  # pragma: no cover - triton is a Linux dependency
    triton = None

# Activations quantised inside the kernel that produces them on CUDA, instead of a separate quantiser
# pass over the model-dtype output (the same codes and scales either way).
FUSED_QUANT = True
SILU_QUANT_BLOCK = 1024  # columns per program of the SiLU-mul quantiser's two launches

if triton is not None:

    @triton.jit
    def _silu_mul_amax_kernel(gu_ptr, x_ptr, amax_ptr, n, stride_gu, BLOCK: tl.constexpr, GDC: tl.constexpr):
        # batchkv.models.fused's silu_mul (the same roundings) on one chunk of a row, and the chunk's
        # max |x| folded into the row's: an int32 atomic max of the float bits (|x| >= 0 orders as its
        # bits; a NaN's bits exceed every number's, so a NaN anywhere makes the row's amax NaN).
        pdl_enter(GDC)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n
        gate = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0)
        up = tl.load(gu_ptr + row * stride_gu + n + cols, mask=mask, other=0.0).to(tl.float32)
        g = gate.to(tl.float32)
        x = ((g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32) * up).to(gate.dtype)
        tl.store(x_ptr + row * n + cols, x, mask=mask)
        bits = tl.abs(x.to(tl.float32)).to(tl.int32, bitcast=True)
        tl.atomic_max(amax_ptr + row, tl.max(bits, axis=0))

    @triton.jit
    def _quantize_by_amax_kernel(x_ptr, amax_ptr, q_ptr, s_ptr, n, INV_MAX: tl.constexpr, MIN_SCALE: tl.constexpr,
                                 BLOCK: tl.constexpr, GDC: tl.constexpr):  # fmt: skip
        # The quantiser on one chunk of a row whose amax (as float bits) is known: `quantize_rows`' arithmetic.
        pdl_enter(GDC)
        row = tl.program_id(0).to(tl.int64)
        chunk = tl.program_id(1)
        cols = chunk * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n
        amax = tl.load(amax_ptr + row).to(tl.float32, bitcast=True)
        scale = tl.where(amax != amax, float("nan"), tl.maximum(amax * INV_MAX, MIN_SCALE))
        v = tl.math.div_rn(tl.load(x_ptr + row * n + cols, mask=mask, other=0.0).to(tl.float32), scale)
        v = tl.where(v != v, v, tl.minimum(tl.maximum(v, -448.0), 448.0))
        tl.store(q_ptr + row * n + cols, v.to(q_ptr.dtype.element_ty), mask=mask)
        if chunk == 0:
            tl.store(s_ptr + row, scale)


def fused(x: torch.Tensor) -> bool:
    """Whether the producers quantise for an `Fp8Linear` reading x (CUDA sm_89+, FUSED_QUANT on, no emulation)."""
    return FUSED_QUANT and triton is not None and x.is_cuda and fp8_gemm(x.device) and not fp8_module.EMULATE


def add_rms_norm_quant(
    h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, *, triton_kernel: bool | None = None
) -> tuple[torch.Tensor, Fp8Rows]:
    """(h + delta, quantize_rows(RMSNorm(h + delta) * weight)) for contiguous [W, H] h and delta: the
    codes and scales of `batchkv.models.fused.add_rms_norm`'s output, bit for bit, in one launch (its
    kernel, quantising instead of storing the normed rows) on NVIDIA sm_89+ (`triton_kernel` None; True
    forces it, e.g. under the interpreter), the two steps elsewhere."""
    use = fused(h) if triton_kernel is None else triton_kernel and triton is not None
    if not use:
        h, x = add_rms_norm(h, delta, weight, eps)
        return h, Fp8Rows(*quantize_rows(x))
    h_out, rows = torch.empty_like(h), _rows_for(h)
    norm_launch(h, weight, eps, delta=delta.contiguous(), h_out=h_out, quant=(*rows, INV_E4M3_MAX, MIN_ACT_SCALE))
    return h_out, rows


def _rows_for(x: torch.Tensor) -> Fp8Rows:
    """Empty codes and scales for the rows of x [..., K]."""
    k = x.shape[-1]
    m = x.numel() // k if k else 0
    return Fp8Rows(
        torch.empty(m, k, dtype=E4M3, device=x.device), torch.empty(m, 1, dtype=torch.float32, device=x.device)
    )


def rms_norm_quant(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, delta: torch.Tensor | None = None, offset: float = 0.0,
    round_first: bool = True, triton_kernel: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, Fp8Rows]:  # fmt: skip
    """transformers' RMSNorm of h = x (or of h = x + delta, transformers' residual add) over the last dim
    (`batchkv.models.fused.rms_norm`'s forms and roundings) and the e4m3 codes and per-row scales of its
    output: (h, normed, Fp8Rows), the codes and scales `quantize_rows(normed)`'s bit for bit. One launch of
    the norm kernel on NVIDIA sm_89+ (`triton_kernel` None; True forces it) for contiguous x (and delta, of
    x's shape and dtype); elsewhere the add, the norm and `quantize_rows` one after the other."""
    use = fused(x) if triton_kernel is None else triton_kernel and triton is not None
    use = use and norm_kernel_ok(x, weight, True) and x.is_contiguous()
    if delta is not None:
        use = use and delta.shape == x.shape and delta.dtype == x.dtype and delta.is_contiguous()
    if not use:
        if delta is None:
            h, out = x, rms_norm(x, weight, eps, offset=offset, round_first=round_first)
        else:
            h = x + delta
            out = rms_norm(h, weight, eps, offset=offset, round_first=round_first)
        return h, out, Fp8Rows(*quantize_rows(out.reshape(-1, out.shape[-1])))
    h = x if delta is None else torch.empty_like(x)
    out = torch.empty(x.shape, dtype=norm_out_dtype(x, weight, round_first), device=x.device)
    rows, shape = _rows_for(x), (-1, x.shape[-1])
    norm_launch(x.view(shape), weight, eps, delta=None if delta is None else delta.view(shape),
                h_out=None if delta is None else h.view(shape), out=out.view(shape),
                quant=(*rows, INV_E4M3_MAX, MIN_ACT_SCALE), offset=offset, round_first=round_first)  # fmt: skip
    return h, out, rows


def silu_mul_quant(gate_up: torch.Tensor, *, triton_kernel: bool | None = None) -> Fp8Rows:
    """quantize_rows(silu(gate) * up) for gate_up = [gate | up] [W, 2I] (last dim contiguous): the codes and
    scales of `batchkv.models.fused.silu_mul` then `quantize_rows`, bit for bit. On NVIDIA sm_89+
    (`triton_kernel` None; True forces it) two launches over chunks of every row, so that all SMs
    stream even at few rows (the quantiser's one program per row is slow on rows this long): SiLU-mul
    with each row's amax gathered by atomics, then the codes; the two steps as written elsewhere."""
    use = fused(gate_up) if triton_kernel is None else triton_kernel and triton is not None
    if not use:
        return Fp8Rows(*quantize_rows(silu_mul_rows(gate_up)))
    w, n = gate_up.shape[0], gate_up.shape[1] // 2
    x = torch.empty(w, n, dtype=gate_up.dtype, device=gate_up.device)
    amax = torch.zeros(w, dtype=torch.int32, device=gate_up.device)
    q = torch.empty(w, n, dtype=E4M3, device=gate_up.device)
    s = torch.empty(w, 1, dtype=torch.float32, device=gate_up.device)
    if w:
        block = min(SILU_QUANT_BLOCK, triton.next_power_of_2(n))
        grid = (w, triton.cdiv(n, block))
        kw = {"BLOCK": block, "num_warps": 4, **pdl_kwargs(gate_up.device)}
        _silu_mul_amax_kernel[grid](gate_up, x, amax, n, gate_up.stride(0), **kw)
        _quantize_by_amax_kernel[grid](x, amax, q, s, n, INV_MAX=INV_E4M3_MAX, MIN_SCALE=MIN_ACT_SCALE, **kw)
    return Fp8Rows(q, s)


def add_rms_norm_for(
    consumer: torch.Tensor | nn.Module, h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | Fp8Rows]:
    """`batchkv.models.fused.add_rms_norm` for a normed output that only `consumer` reads: quantised in
    the same launch (`add_rms_norm_quant`) where `consumer` is an `Fp8Linear` on a GPU that runs it."""
    if isinstance(consumer, Fp8Linear) and fused(h):
        return add_rms_norm_quant(h, delta, weight, eps)
    return add_rms_norm(h, delta, weight, eps)


def silu_mul_linear(gate_up: torch.Tensor, layer: torch.Tensor | nn.Module) -> torch.Tensor:
    """`batchkv.models.gemv.linear(gate_up, layer, silu_mul=True)` (silu(gate) * up, then the projection):
    quantised by `silu_mul_quant` where `layer` is an `Fp8Linear` on a GPU that runs it."""
    if isinstance(layer, Fp8Linear) and fused(gate_up) and gate_up.dim() == 2 and gate_up.stride(-1) == 1:
        return layer(silu_mul_quant(gate_up))
    return linear(gate_up, layer, silu_mul=True)
