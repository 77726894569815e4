"""FP8 (e4m3) linear layers: e4m3 weights with per-output-channel scales, e4m3 activations per token.

A weight W [N, K] is stored as codes Q_w = e4m3(W / s_w) with one float32 scale per output channel,
s_w[n] = max_k |W[n, k]| / 448 (1 for a row of zeros). At run time each row (token) of the input
x [M, K] is quantised the same way, s_x[m] = max(max_k |x[m, k]| / 448, MIN_ACT_SCALE), and

    y[m, n] = (sum_k Q_x[m, k] Q_w[n, k]) * s_x[m] * s_w[n]          (float32, then rounded to bf16)

On NVIDIA sm_89+ the sum runs in hardware: torch's scaled matmul (cuBLASLt, row-wise scales: s_x as
[M, 1], s_w as [1, N]; the weight passed column-major as Q_w.T; K and N multiples of 16) above
`FP8_GEMV_MAX_ROWS` rows, and at fewer rows a Triton kernel that streams the e4m3 weight with
e4m3 tensor-core dots (the few-row case of `batchkv.models.gemv`, at half its bytes); where
`TENSORWISE` says so, the scaled matmul with scalar scales of 1 into float32 sums and the scales
applied after it (`apply_scales`). Inside a model the activations arrive quantised (`Fp8Rows`) from
the kernels that produce them (`batchkv.models.quant.producers`: the add-RMSNorm before q/k/v and
gate/up, the SiLU-mul before down), with the separate quantiser's codes and scales bit for bit. Everywhere
else (the CPU, other GPUs, shapes off the 16 grid) `fp8_matmul_emulated` computes the same codes
and scales and the product in float32: it is the hardware paths' oracle and what CPU runs compute.

Every division is IEEE (round to nearest), so the codes and scales of the torch and Triton
quantisers are identical bit for bit. A NaN anywhere in a row makes that row's scale NaN and its
output row NaN (an infinity: its code is NaN): bad values stay visible, as e4m3 K/V storage keeps them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import nn

from batchkv.errors import ConfigError, ContractError
from batchkv.models.fused import silu_mul as silu_mul_rows
from batchkv.ops.support import fp8_gemm

try:
    import triton
    import triton.language as tl

    from batchkv.ops.pdl import pdl_enter, pdl_kwargs
except ImportError:  # pragma: no cover - triton is a Linux dependency
    triton = None

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
# Scales are amax times the float32 nearest 1/448 (one multiplication, as torch's CUDA division by a
# scalar computes it), so that the CPU, torch on CUDA and the Triton quantiser agree bit for bit.
INV_E4M3_MAX = float(torch.tensor(1.0 / E4M3_MAX, dtype=torch.float32))
MIN_ACT_SCALE = 1.0 / (E4M3_MAX * 512.0)  # a row of zeros (or of tiny values) takes this scale
# Rows up to which the few-row e4m3 kernel runs on CUDA (the scaled matmul above): on the H200 the
# 8B step's matmuls took 3.26 / 3.60 / 3.88 ms at 1 / 16 / 64 rows against the scaled matmul's
# 4.53 / 4.57 / 4.66, and 5.74 against 4.81 at 128 (bench/results/model-step-fp8-h200.json).
FP8_GEMV_MAX_ROWS = 64
# The scaled matmul's fast accumulation (Hopper's FP8 tensor cores keep fewer bits between k-blocks,
# as every FP8 serving stack runs them): 1.16x at 1,024 rows on the H200 (bench/results/model-step-fp8-h200.json).
FAST_ACCUM = True
# Where the scaled matmul runs with scalar scales into float32 sums, `apply_scales` applying the row and
# channel scales after it, instead of with row-wise scales: cuBLASLt picks one tile (128 x 128, 4 x 2
# clusters) for row-wise scales at every shape, too few programs for the narrow projections at a few
# hundred rows. (lowest rows, highest rows, most output channels, fewest input channels) quadruples; True
# everywhere, False nowhere. On the H200 (8B step, every layer's weights; bench/fp8_gemm_ab.py):
# down (4096 x 12288) 0.87 / 1.10 / 1.36 ms against 1.34 / 1.36 / 1.61 at 128 / 256 / 384 rows, o 0.46
# against 0.57 and q/k/v 0.53 against 0.59 at 128, and no gain elsewhere (bench/results/fp8-gemm-ab-h200.json).
TENSORWISE: bool | tuple[tuple[int, int, int, int], ...] = ((65, 128, 6144, 0), (65, 384, 4096, 8192))
_ONES: dict[torch.device, torch.Tensor] = {}
EMULATE = False  # tests and benches: run the emulation on every device
QUANTIZATIONS = ("fp8",)
Reduce = Callable[[torch.Tensor], torch.Tensor]  # a row-parallel layer's join (Shard.all_reduce)


def check_quantization(quantization: str | None) -> str | None:
    """`quantization` if it is None or one of QUANTIZATIONS; else a ConfigError naming the choices."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ConfigError(f"quantization is {quantization!r}; use None (the model's dtype) or one of {QUANTIZATIONS}")
    return quantization


# ---- quantisers (torch: the CPU path and the oracle) -------------------------------------------
def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 codes [N, K] and float32 per-output-channel scales [N] of a weight w [N, K]:
    scale = amax * INV_E4M3_MAX over each row (1 for a row of zeros), codes = e4m3(w / scale)."""
    if w.dim() != 2:
        raise ContractError(f"quantize_weight wants a matrix [N, K]; got shape {tuple(w.shape)}")
    wf = w.float()
    amax = wf.abs().amax(dim=1)
    scale = (amax * INV_E4M3_MAX).masked_fill(amax == 0, 1.0)  # NaN stays NaN
    return _codes(wf, scale[:, None]), scale


def quantize_rows_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 codes [M, K] and float32 scales [M, 1] of activations x [M, K], one scale per row:
    max(amax * INV_E4M3_MAX, MIN_ACT_SCALE)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = torch.clamp(amax * INV_E4M3_MAX, min=MIN_ACT_SCALE)  # clamp keeps NaN
    return _codes(xf, scale), scale


def _codes(xf: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.clamp(xf / scale, -E4M3_MAX, E4M3_MAX).to(E4M3)


def dequantize(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 values of e4m3 `codes` [N, K] with per-row `scale` ([N] or [N, 1])."""
    return codes.float() * scale.reshape(-1, 1)


def fp8_matmul_emulated(
    xq: torch.Tensor, sx: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """(Q_x @ Q_w.T) * s_x * s_w in float32 ([M, K] x [N, K] -> [M, N]), rounded to `dtype`: the
    hardware paths' oracle. Each e4m3 product is exact in float32; only the summation order differs.
    `wq` may also be the codes already widened to float32 (exactly: every e4m3 value is a float32)."""
    return ((xq.float() @ wq.float().T) * sx.reshape(-1, 1) * sw.reshape(1, -1)).to(dtype)


def _hardware(xq: torch.Tensor, n: int) -> bool:
    return not EMULATE and xq.is_cuda and fp8_gemm(xq.device) and xq.shape[1] % 16 == 0 and n % 16 == 0


# ---- Triton kernels (CUDA) ---------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, INV_MAX: tl.constexpr, MIN_SCALE: tl.constexpr,
                              BLOCK: tl.constexpr, GDC: tl.constexpr):  # fmt: skip
        pdl_enter(GDC)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < K
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        nan = tl.sum((x != x).to(tl.int32), axis=0) > 0
        amax = tl.max(tl.abs(x), axis=0)
        scale = tl.maximum(amax * INV_MAX, MIN_SCALE)
        scale = tl.where(nan, float("nan"), scale)  # tl.max and tl.maximum drop NaN; the torch path keeps it
        v = tl.math.div_rn(x, scale)
        v = tl.where(v != v, v, tl.minimum(tl.maximum(v, -448.0), 448.0))
        tl.store(q_ptr + row * K + cols, v.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr + row, scale)

    @triton.jit
    def _scale_kernel(y_ptr, sx_ptr, sw_ptr, out_ptr, N, BLOCK_N: tl.constexpr, GDC: tl.constexpr):
        # out[m, n] = y[m, n] * sx[m] * sw[n] (float32, then rounded): the scaled matmul's row-wise epilogue
        pdl_enter(GDC)
        row = tl.program_id(0).to(tl.int64)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = n < N
        y = tl.load(y_ptr + row * N + n, mask=mask, other=0.0).to(tl.float32)
        sw = tl.load(sw_ptr + n, mask=mask, other=0.0)
        out = y * tl.load(sx_ptr + row) * sw
        tl.store(out_ptr + row * N + n, out.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _fp8_gemv_kernel(x_ptr, sx_ptr, w_ptr, sw_ptr, out_ptr, M, N, K, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GDC: tl.constexpr):  # fmt: skip
        pdl_enter(GDC)
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        m = tl.arange(0, BLOCK_M)
        n_ok = (n < N)[:, None]
        m_ok = (m < M)[:, None]
        w_rows = w_ptr + n.to(tl.int64)[:, None] * K
        x_rows = x_ptr + m.to(tl.int64)[:, None] * K
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)[None, :]
            k_ok = k < K
            w = tl.load(w_rows + k, mask=n_ok & k_ok, other=0.0)  # [BLOCK_N, BLOCK_K] e4m3
            x = tl.load(x_rows + k, mask=m_ok & k_ok, other=0.0)  # [BLOCK_M, BLOCK_K] e4m3
            acc += tl.dot(x, tl.trans(w))
        sx = tl.load(sx_ptr + m, mask=m < M, other=0.0)
        sw = tl.load(sw_ptr + n, mask=n < N, other=0.0)
        out = (acc * sx[:, None] * sw[None, :]).to(out_ptr.dtype.element_ty)
        ptrs = out_ptr + m.to(tl.int64)[:, None] * N + n[None, :]
        tl.store(ptrs, out, mask=m_ok & (n < N)[None, :])


def quantize_rows(x: torch.Tensor, *, triton_kernel: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows_torch` of x [M, K] (last dim contiguous): one Triton launch on NVIDIA sm_89+
    (`triton_kernel` None), torch elsewhere; the same codes and scales either way. Capturable."""
    use = (x.is_cuda and fp8_gemm(x.device) and not EMULATE) if triton_kernel is None else triton_kernel
    if not use or triton is None:
        return quantize_rows_torch(x)
    m, k = x.shape
    q = torch.empty(m, k, dtype=E4M3, device=x.device)
    s = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m:
        block = triton.next_power_of_2(k)
        _quantize_rows_kernel[(m,)](x, q, s, k, x.stride(0), INV_MAX=INV_E4M3_MAX, MIN_SCALE=MIN_ACT_SCALE, BLOCK=block,
                                    num_warps=min(16, max(4, block // 1024)), **pdl_kwargs(x.device))  # fmt: skip
    return q, s


class Fp8Rows(NamedTuple):
    """Activations already quantised per row (a fused producer's output): e4m3 `codes` [M, K] and
    float32 `scale` [M, 1], as `quantize_rows` returns them. `Fp8Linear` takes them in place of x."""

    codes: torch.Tensor
    scale: torch.Tensor


def fp8_gemv(
    xq: torch.Tensor, sx: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor, dtype: torch.dtype, *, block_n: int = 32,
    block_k: int = 256, num_stages: int = 4, num_warps: int = 4,
) -> torch.Tensor:  # fmt: skip
    """`fp8_matmul_emulated` for few rows in one Triton launch (e4m3 dots, float32 sums): one program per
    `block_n` outputs, all rows in one tile (16 at least). Capturable."""
    (m, k), n = xq.shape, wq.shape[0]
    out = torch.empty(m, n, dtype=dtype, device=xq.device)
    _fp8_gemv_kernel[(triton.cdiv(n, block_n),)](
        xq, sx, wq, sw, out, m, n, k, BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=num_warps, num_stages=num_stages, **pdl_kwargs(xq.device),
    )  # fmt: skip
    return out


def apply_scales(y: torch.Tensor, sx: torch.Tensor, sw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """y [M, N] (the unscaled float32 sums) * sx [M, 1] * sw [N], rounded to `dtype`: one launch. Capturable."""
    m, n = y.shape
    out = torch.empty(m, n, dtype=dtype, device=y.device)
    if m:
        block = min(2048, triton.next_power_of_2(n))
        _scale_kernel[(m, triton.cdiv(n, block))](y, sx, sw, out, n, BLOCK_N=block, num_warps=4, **pdl_kwargs(y.device))
    return out


def _tensorwise(m: int, n: int, k: int) -> bool:
    """Whether the unscaled (scalar-scale) GEMM plus `apply_scales` runs an [m, k] x [k, n] product
    (see TENSORWISE)."""
    return TENSORWISE is True or (TENSORWISE is not False and any(
        lo <= m <= hi and n <= n_max and k >= k_min for lo, hi, n_max, k_min in TENSORWISE))  # fmt: skip


def fp8_matmul(
    xq: torch.Tensor, sx: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """(Q_x @ Q_w.T) * s_x * s_w rounded to `dtype`: in hardware where the device and shapes allow
    (see the module docstring), else `fp8_matmul_emulated`."""
    m, n = xq.shape[0], wq.shape[0]
    if not _hardware(xq, n):
        return fp8_matmul_emulated(xq, sx, wq, sw, dtype)
    one = _ONES.get(xq.device)
    if one is None and not torch.cuda.is_current_stream_capturing():  # made eagerly (a capture only replays it)
        one = _ONES[xq.device] = torch.ones((), device=xq.device)
    if one is not None and triton is not None and _tensorwise(m, n, xq.shape[1]):  # the weight column-major
        y = torch._scaled_mm(xq, wq.T, scale_a=one, scale_b=one, out_dtype=torch.float32, use_fast_accum=FAST_ACCUM)
        return apply_scales(y, sx, sw, dtype)
    if m <= FP8_GEMV_MAX_ROWS and triton is not None:
        return fp8_gemv(xq, sx, wq, sw, dtype)
    # Row-wise scaling wants bf16 out.
    y = torch._scaled_mm(xq, wq.T, scale_a=sx.reshape(m, 1), scale_b=sw.reshape(1, n), out_dtype=torch.bfloat16,
                         use_fast_accum=FAST_ACCUM)  # fmt: skip
    return y if dtype == torch.bfloat16 else y.to(dtype)


# ---- the layer ---------------------------------------------------------------------------------
class Fp8Linear(nn.Module):
    """`nn.Linear` with e4m3 weights: `weight` [N, K] float8_e4m3fn, `weight_scale` [N] float32,
    optional `bias` [N] in `dtype`; inputs and outputs in `dtype` (the model's).

    `reduce` (e.g. `Shard.all_reduce` of a row-parallel projection) runs on the product before the
    bias is added, as `batchkv.models.parallel.layers.RowParallelLinear` does. Capturable.

    >>> layer = Fp8Linear.from_linear(nn.Linear(4096, 4096, bias=False, dtype=torch.bfloat16))
    >>> y = layer(x)   # x [..., 4096] bf16 -> [..., 4096] bf16
    """

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None, *,
                 dtype: torch.dtype = torch.bfloat16, reduce: Reduce | None = None):  # fmt: skip
        super().__init__()
        if weight.dtype != E4M3 or weight.dim() != 2 or scale.shape != (weight.shape[0],):
            raise ContractError(f"Fp8Linear wants e4m3 weight [N, K] and float32 scales [N]; got {weight.dtype} "
                                f"{tuple(weight.shape)} and {tuple(scale.shape)}")  # fmt: skip
        self.out_features, self.in_features = weight.shape
        self.weight = nn.Buffer(weight.contiguous())
        self.weight_scale = nn.Buffer(scale.to(torch.float32).contiguous())
        self.bias = None if bias is None else nn.Buffer(bias.to(dtype))
        self.dtype = dtype
        self.reduce = reduce

    @classmethod
    def from_weight(cls, w: torch.Tensor, bias: torch.Tensor | None = None, *,
                    reduce: Reduce | None = None) -> Fp8Linear:  # fmt: skip
        """The layer of a float weight w [N, K] (quantised per output channel); inputs in w's dtype."""
        codes, scale = quantize_weight(w.detach())
        return cls(codes, scale, None if bias is None else bias.detach(), dtype=w.dtype, reduce=reduce)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Fp8Linear:
        """The layer of an `nn.Linear` (a row-parallel one keeps its all-reduce)."""
        shard = getattr(linear, "shard", None)
        reduce = shard.all_reduce if shard is not None and shard.world > 1 else None
        return cls.from_weight(linear.weight, linear.bias, reduce=reduce)

    def forward(
        self, x: torch.Tensor | Fp8Rows, *, silu_mul: bool = False, out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """x [..., K] (with silu_mul: [..., 2K] = [gate | up], taking silu(gate) * up) -> [..., N];
        or x already quantised (`Fp8Rows` of [M, K], from `batchkv.models.quant.producers`) -> [M, N]."""
        if isinstance(x, Fp8Rows):
            lead, (xq, sx) = x.codes.shape[:-1], x
        else:
            if silu_mul:
                x = silu_mul_rows(x)
            lead = x.shape[:-1]
            x2 = x.reshape(-1, x.shape[-1])
            if x2.stride(-1) != 1:
                x2 = x2.contiguous()
            xq, sx = quantize_rows(x2)
        if _hardware(xq, self.out_features):
            y = fp8_matmul(xq, sx, self.weight, self.weight_scale, self.dtype)
        else:  # the emulation, on codes widened once (widening e4m3 on the CPU costs more than the product)
            y = fp8_matmul_emulated(xq, sx, self._widened(), self.weight_scale, self.dtype)
        if self.reduce is not None:
            y = self.reduce(y)
        if self.bias is not None:
            y = y + self.bias
        y = y.reshape(*lead, self.out_features)
        return y if out_dtype is None else y.to(out_dtype)

    def _widened(self) -> torch.Tensor:
        """The codes as float32 (for the emulation), kept while the weight stays where it is."""
        key = (self.weight.data_ptr(), self.weight.device)
        if getattr(self, "_widened_key", None) != key:
            self._widened_codes, self._widened_key = self.weight.float(), key
        return self._widened_codes

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3 per-channel, {self.dtype}"


def quantize_layers(parent: nn.Module, names: Sequence[str]) -> int:
    """Replace each of `parent`'s attributes `names` that is an `nn.Linear` or a weight matrix
    (a 2-D parameter, as SenseNova's fused projections) by its `Fp8Linear`; others are left alone.
    Returns how many were replaced; the float weights are then free."""
    done = 0
    for name in names:
        part = getattr(parent, name, None)
        if isinstance(part, nn.Linear):
            layer = Fp8Linear.from_linear(part)
        elif isinstance(part, torch.Tensor) and part.dim() == 2 and part.is_floating_point():
            layer = Fp8Linear.from_weight(part.data)
        else:
            continue
        delattr(parent, name)
        setattr(parent, name, layer)
        done += 1
    return done
