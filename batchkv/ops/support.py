"""What the kernels take: K/V storage dtypes, head dims, and the e4m3 storage format.

`refusal(kv_dtype, head_dim, backend, device, value_dim)` is the one place that says which storage
dtype and key and value widths an attention backend serves (and on which GPUs); `CacheConfig`, the
cache, both Triton launchers and
`paged_decode_supported` ask it, so a rule changes in one line.

e4m3 storage (`torch.float8_e4m3fn`): each stored K or V row of D elements (one position, one KV
head) keeps e4m3 codes and one fp32 scale, `scale = max(amax / 448, 2^-126)` with amax the row's
max-abs, so `code * scale` is the value. 448 is e4m3fn's largest finite value; the floor (the
smallest normal fp32) gives an all-zero row codes 0 and a finite scale, which dequantise to exact
zeros. Scales are fp32 rather than 16-bit: amax / 448 is then exact IEEE arithmetic for any
amax (fp16 would go subnormal below amax ~ 0.027). A row holding a NaN or an infinity (e4m3 has
none) stores a NaN scale and every code 0x7F, so the whole row reads back NaN, never a finite value.

Scale planes are logically [rows, C, Hkv] (row first, like K and V, so torch code indexes them
alike) but stored [C, Hkv, rows] (`empty_scales`): an attention program walks one (column, KV
head) over consecutive positions, and its per-tile [BLOCK_N] scale vector is then BLOCK_N * 4
contiguous bytes instead of BLOCK_N gathers C * Hkv * 4 bytes apart (one 32-byte sector each).
The kernels take the three strides, so any layout works; this one is the fast one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from batchkv.dtypes import MODEL_DTYPES, STORAGE_DTYPES

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
SCALE_FLOOR = 2.0**-126  # smallest normal fp32: the scale of an all-zero row
SCALE_DTYPE = torch.float32
SCALE_PLANES = ("k_scale", "v_scale")  # the e4m3 planes beside "k" and "v", stored as `empty_scales` makes them
COMPUTE_DTYPES = tuple(MODEL_DTYPES.values())  # q, and K/V handed to the write
HEAD_DIMS = tuple(range(16, 257, 16))  # widths the Triton kernels take: tiles of the next power of two, masked


def quantized(kv_dtype: torch.dtype) -> bool:
    """True when `kv_dtype` stores codes plus a scale per (position, KV head) plane."""
    return kv_dtype == FP8


def refusal(
    kv_dtype: torch.dtype,
    head_dim: int,
    backend: str = "triton",
    device: torch.device | None = None,
    value_dim: int | None = None,
) -> str | None:
    """Why `backend` ("triton" or "reference") cannot store and attend this geometry (on `device`,
    when given); None when it can. `head_dim` is the width of queries and keys, `value_dim` that of
    the values (None: head_dim).

    Both backends store bf16, fp16, fp32 or e4m3 (`torch.float8_e4m3fn`) K/V; the Triton kernels
    also need each width a multiple of 16 from 16 to 256 (tiles are the next power of two, the
    columns past the width masked; the torch reference takes any), and for e4m3 an NVIDIA GPU from
    sm_89 (Triton has no e4m3 tensors before Ada).
    """
    if kv_dtype not in STORAGE_DTYPES.values():
        return (
            f"kv_dtype {kv_dtype} is not a K/V storage dtype batchkv takes; use one of "
            f"{', '.join(f'torch.{name}' for name in STORAGE_DTYPES)}"
        )
    for name, dim in (("head_dim", head_dim), ("value_dim", head_dim if value_dim is None else value_dim)):
        if backend == "triton" and dim not in HEAD_DIMS:
            return f"{name} {dim!r}: the Triton kernels take a multiple of 16 from 16 to 256"
    nvidia = device is not None and device.type == "cuda" and torch.version.hip is None
    if backend == "triton" and quantized(kv_dtype) and nvidia and not e4m3_cvt_asm(device):
        major, minor = torch.cuda.get_device_capability(device.index)
        return (
            f"e4m3 K/V storage in the Triton kernels needs an NVIDIA GPU of compute capability 8.9 or newer "
            f"(Ada, Hopper); {torch.cuda.get_device_name(device.index)} is compute capability {major}.{minor} "
            "(store bf16 K/V)"
        )
    return None


def empty_scales(
    rows: int, columns: int, kv_heads: int, *, device: torch.device | str | None = None, alloc: Callable = torch.empty
) -> torch.Tensor:
    """An uninitialised fp32 scale plane [rows, C, Hkv] in the kernels' layout: stored [C, Hkv, rows]
    (strides (1, Hkv * rows, rows)), so each (column, KV head)'s positions are contiguous.

    `alloc(shape, dtype=, device=)` makes the storage (the store injects failures through it).

    >>> s = empty_scales(1024, 65, 8, device="cuda")  # s[r, c, h]: position r % rows, column c, head h
    """
    return alloc((columns, kv_heads, rows), dtype=SCALE_DTYPE, device=device).permute(2, 0, 1)


def to_scale_layout(scales: torch.Tensor) -> torch.Tensor:
    """A copy of fp32 scales [rows, C, Hkv] (any strides) in `empty_scales`' layout."""
    return empty_scales(*scales.shape, device=scales.device).copy_(scales)


def scales_refusal(
    store_dtype: torch.dtype,
    device: torch.device,
    want: tuple[int, ...],
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> str | None:
    """Why k_scale, v_scale do not fit K/V storage of `store_dtype` on `device`; None when they do.

    e4m3 stores need both: fp32 of shape `want` ([rows, C, Hkv]) on the device, with one set of
    strides (any: the kernels take them; `empty_scales`' layout is the fast one). Other stores
    take none.
    """
    if not quantized(store_dtype):
        return (
            None if k_scale is None and v_scale is None else f"k_scale/v_scale are for {FP8} stores, not {store_dtype}"
        )
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is None or s.dtype != SCALE_DTYPE or tuple(s.shape) != want or s.device != device:
            got = "None" if s is None else f"{s.dtype} {tuple(s.shape)} on {s.device}"
            return f"{FP8} stores need {name} fp32 {list(want)} on {device}; got {got}"
    if k_scale.stride() != v_scale.stride():
        return f"k_scale and v_scale need the same strides; got {k_scale.stride()} and {v_scale.stride()}"
    return None


def _cuda_index(device: torch.device) -> int:
    """The index of a CUDA device (`cuda` alone: the current one): the key of the per-device caches."""
    return device.index if device.index is not None else torch.cuda.current_device()


_CAPABILITY: dict[int, tuple[int, int]] = {}


def _nvidia_at_least(device: torch.device, version: tuple[int, int]) -> bool:
    """Whether `device` is an NVIDIA GPU of compute capability `version` or newer (cached per device);
    False for the CPU (the interpreter) and ROCm."""
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    index = _cuda_index(device)
    if index not in _CAPABILITY:
        _CAPABILITY[index] = torch.cuda.get_device_capability(index)
    return _CAPABILITY[index] >= version


def e4m3_cvt_asm(device: torch.device) -> bool:
    """Whether the kernels convert e4m3 codes with inline PTX (`cvt.rn.f16x2.e4m3x2`, NVIDIA sm_89+);
    elsewhere (the interpreter, ROCm) they use Triton's conversions. Triton has e4m3 tensors on
    NVIDIA GPUs from sm_89 only: `refusal` refuses older ones."""
    return _nvidia_at_least(device, (8, 9))


def fp8_gemm(device: torch.device) -> bool:
    """Whether `device` multiplies e4m3 matrices in hardware (torch's scaled matmul through cuBLASLt and
    Triton's e4m3 dots): NVIDIA sm_89+ (Ada, Hopper). Elsewhere FP8 layers run their exact emulation."""
    return _nvidia_at_least(device, (8, 9))


def pdl_launch(device: torch.device) -> bool:
    """Whether kernels on `device` may use programmatic dependent launch (Triton's `launch_pdl` and
    `griddepcontrol`): NVIDIA sm_90+; never under the interpreter or on ROCm."""
    return _nvidia_at_least(device, (9, 0))


def tma_loads(device: torch.device) -> bool:
    """Whether kernels on `device` may load through TMA descriptors: NVIDIA sm_90+, or the CPU (the
    interpreter runs them); never ROCm."""
    return device.type == "cpu" or _nvidia_at_least(device, (9, 0))


_SMS: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached); 4 elsewhere, where kernels run under the
    interpreter and few programs keep tests quick. Grids sized from it stay fixed per device."""
    if device.type != "cuda":
        return 4
    index = _cuda_index(device)
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]
