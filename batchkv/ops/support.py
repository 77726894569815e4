"""What the kernels take: K/V storage dtypes, head dims, and the e4m3 storage format.

`refusal(kv_dtype, head_dim, backend)` is the one place that says which storage dtype and head_dim
an attention backend serves; `CacheConfig`, the cache, both Triton launchers and
`paged_decode_supported` ask it, so a rule changes in one line.

e4m3 storage (`torch.float8_e4m3fn`): each stored K or V row of D elements (one position, one KV
head) keeps e4m3 codes and one fp32 scale, `scale = max(amax / 448, 2^-126)` with amax the row's
max-abs, so `code * scale` is the value. 448 is e4m3fn's largest finite value; the floor (the
smallest normal fp32) gives an all-zero row codes 0 and a finite scale, which dequantise to exact
zeros. Scales are fp32 rather than 16-bit: amax / 448 is then exact IEEE arithmetic for any
amax (fp16 would go subnormal below amax ~ 0.027), and 16-bit scales would save nothing read from
memory, since the Hkv = 8 scales of one (row, column) are one 32-byte sector either way.
"""

from __future__ import annotations

import torch

from batchkv.dtypes import MODEL_DTYPES, STORAGE_DTYPES

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
SCALE_FLOOR = 2.0**-126  # smallest normal fp32: the scale of an all-zero row
SCALE_DTYPE = torch.float32
COMPUTE_DTYPES = tuple(MODEL_DTYPES.values())  # q, and K/V handed to the write
HEAD_DIMS = (16, 32, 64, 128, 256)  # the Triton kernels' tiles: powers of two


def quantized(kv_dtype: torch.dtype) -> bool:
    """True when `kv_dtype` stores codes plus a scale per (position, KV head) plane."""
    return kv_dtype == FP8


def refusal(kv_dtype: torch.dtype, head_dim: int, backend: str = "triton") -> str | None:
    """Why `backend` ("triton" or "reference") cannot store and attend this geometry; None when it can.

    Both backends store bf16, fp16, fp32 or e4m3 (`torch.float8_e4m3fn`) K/V; the Triton kernels
    also need head_dim a power of two from 16 to 256 (the torch reference takes any).
    """
    if kv_dtype not in STORAGE_DTYPES.values():
        return (
            f"kv_dtype {kv_dtype} is not a K/V storage dtype batchkv takes; use one of "
            f"{', '.join(f'torch.{name}' for name in STORAGE_DTYPES)}"
        )
    if backend == "triton" and head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim!r}: the Triton kernels take one of {', '.join(map(str, HEAD_DIMS))}"
    return None


def scales_refusal(store: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> str | None:
    """Why k_scale, v_scale do not fit K/V storage `store` [..., Hkv, D]; None when they do.

    e4m3 stores need both: fp32 [..., Hkv] on the store's device, one set of strides, heads
    contiguous. Other stores take none.
    """
    if not quantized(store.dtype):
        return (
            None if k_scale is None and v_scale is None else f"k_scale/v_scale are for {FP8} stores, not {store.dtype}"
        )
    want = tuple(store.shape[:-1])
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is None or s.dtype != SCALE_DTYPE or tuple(s.shape) != want or s.device != store.device:
            got = "None" if s is None else f"{s.dtype} {tuple(s.shape)} on {s.device}"
            return f"{FP8} stores need {name} fp32 {list(want)} on {store.device}; got {got}"
    if k_scale.stride() != v_scale.stride() or k_scale.stride(-1) != 1:
        return "k_scale and v_scale need the same strides and contiguous heads"
    return None


_SMS: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached); 4 elsewhere, where kernels run under the
    interpreter and few programs keep tests quick. Grids sized from it stay fixed per device."""
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]
