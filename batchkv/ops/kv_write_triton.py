"""kv_write: the step's K and V rows into the column store, both in one Triton launch.

`k_flat[slots[i]] = k[i]` and `v_flat[slots[i]] = v[i]`, cast to the store dtype; the same contract
as `kv_write_reference`. One program per token copies its [Hkv, D] rows of K and of V, 16-byte
vectorised along D. Slots are int64 and offsets are computed in int64 (rows * C * Hkv * D can pass
2^31). Padding tokens carry slots in the scratch column, so every slot is written and none is read
by attention. Capturable: no host reads, grid = (W,).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from batchkv.errors import ContractError
from batchkv.ops import kernel_problem


@triton.jit
def _kv_write_kernel(k_flat, v_flat, k, v, slots, stride_fs, stride_fh, stride_ks, stride_kh, stride_vs, stride_vh,
                     HKV: tl.constexpr, H_POW2: tl.constexpr, HEAD_DIM: tl.constexpr):  # fmt: skip
    i = tl.program_id(0)
    slot = tl.load(slots + i).to(tl.int64)
    h = tl.arange(0, H_POW2)[:, None]
    d = tl.arange(0, HEAD_DIM)[None, :]
    ok = h < HKV
    dst = slot * stride_fs + h * stride_fh + d  # k_flat and v_flat share strides
    row = i.to(tl.int64)
    k_row = tl.load(k + row * stride_ks + h * stride_kh + d, mask=ok)
    v_row = tl.load(v + row * stride_vs + h * stride_vh + d, mask=ok)
    tl.store(k_flat + dst, k_row.to(k_flat.dtype.element_ty), mask=ok)
    tl.store(v_flat + dst, v_row.to(v_flat.dtype.element_ty), mask=ok)


def kv_write(k_flat: torch.Tensor, v_flat: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Write this step's K/V rows at their store slots, one launch for both.

    k_flat, v_flat: [rows * C, Hkv, D] views of the store (one dtype and strides, last dim
    contiguous); k, v: [W, Hkv, D] in any float dtype (cast on write); slots: int64 (or int32) [W]
    on the same device. D as `batchkv.ops.kernel_problem` allows. Capturable (no host reads).

    >>> kv_write(*cache._store.flat_views(0), k, v, slots)  # k, v [W, 8, 128]; slots [W]
    """
    if k_flat.dim() != 3 or k_flat.shape != v_flat.shape or k.shape != v.shape or k.dim() != 3:
        raise ContractError(
            f"kv_write wants k_flat, v_flat [N, Hkv, D] and k, v [W, Hkv, D]; got {tuple(k_flat.shape)}, "
            f"{tuple(v_flat.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    width, num_kv_heads, head_dim = k.shape
    if k_flat.shape[1:] != k.shape[1:] or kernel_problem(head_dim):
        raise ContractError(
            f"store rows {tuple(k_flat.shape[1:])} and k rows {tuple(k.shape[1:])} must match; "
            f"{kernel_problem(head_dim) or 'they differ'}"
        )
    if slots.dtype not in (torch.int64, torch.int32) or slots.shape != (width,):
        raise ContractError(f"slots must be int64 or int32 [{width}]; got {slots.dtype} {tuple(slots.shape)}")
    if not k_flat.device == v_flat.device == k.device == v.device == slots.device:
        raise ContractError("k_flat, v_flat, k, v and slots must share a device")
    if k_flat.dtype != v_flat.dtype or k_flat.stride() != v_flat.stride() or not k.dtype.is_floating_point:
        raise ContractError(f"stores must share dtype and strides; got {k_flat.dtype}/{v_flat.dtype}, {k.dtype}")
    if any(x.stride(-1) != 1 for x in (k_flat, k, v)) or slots.stride(0) != 1:
        raise ContractError("k_flat, k, v need a contiguous last dim and slots stride 1; call .contiguous()")
    if width == 0:
        return
    _kv_write_kernel[(width,)](
        k_flat, v_flat, k, v, slots, k_flat.stride(0), k_flat.stride(1), k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), HKV=num_kv_heads, H_POW2=triton.next_power_of_2(num_kv_heads), HEAD_DIM=head_dim, num_warps=4,
    )  # fmt: skip
