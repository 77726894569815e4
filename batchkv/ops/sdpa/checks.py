"""`sdpa_varlen`'s argument checks: every refusal is a `ContractError` raised before anything is
written or launched."""

from __future__ import annotations

import math

import torch

from batchkv.checks import int_arg
from batchkv.errors import ContractError
from batchkv.ops.support import COMPUTE_DTYPES, quantized, refusal, scales_refusal


def check_extras(q: torch.Tensor, softcap: float, sinks: torch.Tensor | None, live: torch.Tensor | None = None) -> None:
    """Refuse a soft-cap that is not a finite number >= 0, sinks that are not one float logit per
    query head ([Hq], contiguous, on q's device), and a live-row count that is not one int32 on q's device."""
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not 0 <= softcap < math.inf:
        raise ContractError(f"sdpa_varlen: softcap is {softcap!r}; use 0 (none) or a positive finite number")
    live is None or _check_live(live, q)
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor):
        raise ContractError(f"sdpa_varlen: sinks is a {type(sinks).__name__}; pass a float tensor [Hq] or None")
    if sinks.shape != (q.shape[1],) or sinks.dtype not in COMPUTE_DTYPES or sinks.stride() != (1,):
        raise ContractError(
            f"sdpa_varlen: sinks must be one fp16/bf16/fp32 logit per query head, contiguous [{q.shape[1]}]; "
            f"got {sinks.dtype} {list(sinks.shape)} strides {sinks.stride()}"
        )
    if sinks.device != q.device:
        raise ContractError(f"sdpa_varlen: sinks are on {sinks.device}, q on {q.device}; move them to q's device")


def check_call(
    q: torch.Tensor,
    k_store: torch.Tensor,
    v_store: torch.Tensor,
    seq_info: torch.Tensor,
    scale: float | None,
    window: int,
    out: torch.Tensor | None,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    """Refuse (`ContractError`, saying what to pass instead) a call whose tensors break `sdpa_varlen`'s
    contract: shapes, head counts, dtypes, the e4m3 scales and pairs, contiguous last dims, one device,
    the seq_info table, the window, the scale and `out`."""
    if q.dim() != 3 or k_store.dim() != 4 or v_store.dim() != 4 or k_store.shape[:3] != v_store.shape[:3]:
        raise ContractError(
            "sdpa_varlen wants q [T, Hq, D], k_store [rows, C, Hkv, D] and v_store [rows, C, Hkv, Dv]; "
            f"got {tuple(q.shape)}, {tuple(k_store.shape)}, {tuple(v_store.shape)}"
        )
    num_q_heads, head_dim = q.shape[1:]
    rows, _, num_kv_heads, store_dim = k_store.shape
    if store_dim != head_dim:
        raise ContractError(f"sdpa_varlen: q has head_dim {head_dim} but the key store {store_dim}")
    problem = refusal(k_store.dtype, head_dim, device=k_store.device, value_dim=v_store.shape[3])
    if problem:
        raise ContractError(f"sdpa_varlen: {problem}")
    if num_kv_heads < 1 or num_q_heads < 1 or num_q_heads % num_kv_heads:
        raise ContractError(
            f"Hq={num_q_heads} is not a positive multiple of Hkv={num_kv_heads}; GQA needs Hq % Hkv == 0"
        )
    if rows < 1:
        raise ContractError("the stores have 0 rows; grow the cache before attending")
    if q.dtype not in COMPUTE_DTYPES or v_store.dtype != k_store.dtype:
        raise ContractError(
            f"q must be fp16/bf16/fp32 and both stores one dtype; got {q.dtype}, {k_store.dtype}, {v_store.dtype}"
        )
    problem = scales_refusal(k_store.dtype, k_store.device, tuple(k_store.shape[:-1]), k_scale, v_scale)
    if problem:
        raise ContractError(f"sdpa_varlen: {problem}")
    if quantized(k_store.dtype):  # the kernels read e4m3 codes two at a time, as int16
        odd = [x for x in (k_store, v_store) if x.storage_offset() % 2 or any(n % 2 for n in x.stride()[:3])]
        if odd:
            raise ContractError(
                f"sdpa_varlen: e4m3 stores need even strides and offsets (codes are read in pairs); got strides "
                f"{odd[0].stride()} at offset {odd[0].storage_offset()} (pass a view of an even-sized store)"
            )
    if q.stride(-1) != 1 or k_store.stride(-1) != 1 or v_store.stride(-1) != 1:
        raise ContractError(
            "q and the stores need a contiguous last dim; "
            f"got {q.stride()}, {k_store.stride()}, {v_store.stride()} (call .contiguous())"
        )
    if not q.device == k_store.device == v_store.device == seq_info.device:
        raise ContractError(
            f"q, the stores and seq_info must share a device; got {q.device}, {k_store.device}, "
            f"{v_store.device}, {seq_info.device}"
        )
    if seq_info.dtype != torch.int32 or seq_info.dim() != 2 or seq_info.shape[1] != 4 or seq_info.stride(-1) != 1:
        raise ContractError(f"seq_info must be int32 [S, 4], rows contiguous; got {seq_info.dtype} {seq_info.shape}")
    if seq_info.shape[0] > 1 and seq_info.stride(0) != 4:
        raise ContractError("seq_info rows must be packed (stride 4); pass seq_info.contiguous()")
    int_arg("sdpa_varlen: window", window, 0, error=ContractError, why=" (0: none)")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise ContractError(f"sdpa_varlen: scale is {scale!r}; use None (1/sqrt(D)) or a number")
    want = (*q.shape[:2], v_store.shape[3])  # [T, Hq, Dv]
    if out is not None and (
        tuple(out.shape) != want or out.dtype != q.dtype or out.device != q.device or out.stride(-1) != 1
    ):
        raise ContractError(
            f"out must be {want} {q.dtype} on {q.device} with a contiguous last dim; "
            f"got {tuple(out.shape)} {out.dtype} on {out.device}"
        )


def _check_live(live: torch.Tensor, q: torch.Tensor) -> None:
    """Refuse a live-row count that is not an int32 tensor of one element on q's device."""
    if not isinstance(live, torch.Tensor) or live.dtype != torch.int32 or live.numel() != 1:
        got = f"{live.dtype} {list(live.shape)}" if isinstance(live, torch.Tensor) else type(live).__name__
        raise ContractError(f"sdpa_varlen: live must be an int32 tensor of one element (the live rows); got {got}")
    if live.device != q.device:
        raise ContractError(f"sdpa_varlen: live is on {live.device}, q on {q.device}; stage it on q's device")
