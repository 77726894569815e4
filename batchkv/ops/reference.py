"""Pure-torch references of the sdpa_varlen contract and the step's K/V write.

These are the oracles: the Triton kernels must match them, and the cache uses them where there is
no GPU. They read `seq_info` on the host (`tolist()`), so they are not capturable in a CUDA graph.

e4m3 storage (see `batchkv.ops.support`) is the same arithmetic as the Triton kernels: the write
quantises each row of D elements with `quantize_fp8`, attention dequantises `code * scale` in fp32,
with exact queries. The Triton default also rounds the queries of prompt chunks to e4m3
(`SdpaConfig.e4m3_qk_long`); `quantize_queries` makes those codes, to compare against.

Contract (`sdpa_varlen`), for each row s of `seq_info` = (q_start, q_len, col, kv_end):
- query i in [0, q_len) is packed row `q_start + i` and sits at position `p_i = kv_end - q_len + i`;
- causal rows attend keys t in [lo_i, p_i], lo_i = max(0, p_i - window + 1) when windowed, else 0;
- non-causal rows attend t in [lo, kv_end), lo = max(0, kv_end - window) when windowed, else 0;
- only t >= kv_end - rows is resident (ring storage); key t lives at slot `(t % rows) * C + col` of the
  store viewed [R * C, Hkv, D], which is store[t % rows, col] (`rows` defaults to the store's R); with
  one column (C = 1, a pool of extents) `col` is the first row of the segment's extent;
- GQA: query head h reads KV head h // (Hq // Hkv);
- rows of q no segment covers, and rows with no resident key, come out as exact zeros;
- softcap > 0 caps each scaled score: s = softcap * tanh(scale * q.k / softcap) (Gemma2's order:
  the softmax scale first, then the cap, then the mask);
- sinks [Hq]: one more logit per query head in each row's softmax denominator, unscaled and
  uncapped, whose probability is dropped (gpt-oss): out = sum_t e^s_t v_t / (e^sink + sum_t e^s_t).
"""

from __future__ import annotations

import math

import torch

from batchkv.errors import ContractError
from batchkv.ops.rope import rotate_step
from batchkv.ops.support import FP8, FP8_MAX, SCALE_FLOOR


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] float -> (codes float8_e4m3fn [..., D], scales float32 [...]), one scale per row.

    scale = max(amax / 448, 2^-126); code = e4m3(x / scale) rounded to nearest even (the division
    is IEEE fp32 and |x / scale| <= 448 after a clamp). `codes.float() * scale` is the stored value.
    A row holding a NaN or an infinity (e4m3 has none) gets a NaN scale and every code 0x7F, e4m3fn's
    NaN with the sign bit clear, whatever the NaN's sign: the whole row reads back NaN (as the
    rounding of a NaN query row does), never a finite value.

    >>> codes, scales = quantize_fp8(torch.randn(5, 8, 128))  # [5, 8, 128] e4m3, [5, 8] fp32
    """
    x = x.float()
    bad = ~x.isfinite().all(-1)  # [...] rows holding a NaN or an infinity
    scale = _row_scales(x).masked_fill(bad, float("nan"))
    y = (x / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).masked_fill(bad[..., None], float("nan"))  # NaN: 0x7F
    return y.to(FP8), scale


def _row_scales(x: torch.Tensor) -> torch.Tensor:
    """fp32 x [..., D] -> max(amax / 448, 2^-126) per row [...], the IEEE division of the kernels."""
    amax = x.abs().amax(-1)
    # A tensor divisor, not the float: CUDA torch divides by a Python scalar as a multiply by its
    # reciprocal, 1 ulp off amax / 448 at times, and the codes near a rounding tie move with it.
    return (amax / torch.full_like(amax, FP8_MAX)).clamp_min(SCALE_FLOOR)


def quantize_queries(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [..., D] -> (codes float8_e4m3fn [..., D], scales float32 [...]) as the long path quantises
    queries under `SdpaConfig.e4m3_qk_long`: `quantize_fp8`'s scale per row, codes e4m3(q * (1 /
    scale)) (one IEEE reciprocal per row, then a multiply), rounded to nearest even."""
    q = q.float()
    scale = _row_scales(q)
    return (q * (torch.ones_like(scale) / scale)[..., None]).to(FP8), scale


def dequantize_fp8(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """codes e4m3 [..., D] and scales fp32 [...] -> values [..., D] in `dtype` (computed in fp32)."""
    return (codes.float() * scale[..., None].float()).to(dtype)


def _read(store: torch.Tensor, scale: torch.Tensor | None, at: tuple) -> torch.Tensor:
    """fp32 rows store[at] ([..., Hkv, D]), dequantised when the store is e4m3."""
    return store[at].float() if scale is None else dequantize_fp8(store[at], scale[at])


def sdpa_varlen_reference(
    q: torch.Tensor,
    k_store: torch.Tensor,
    v_store: torch.Tensor,
    seq_info: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = True,
    window: int = 0,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    write: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    rows: int | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    max_q_len: int | None = None,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    live: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of packed queries over the column store, computed in float32.

    q: [T, Hq, D]; k_store: [R, C, Hkv, D]; v_store: [R, C, Hkv, Dv] (values may be narrower or
    wider than keys: multi-head latent attention); seq_info: int [S, 4] (any device);
    k_scale, v_scale: fp32 [R, C, Hkv] for e4m3 stores (the value is code * scale), else None.
    write: (k, v, slots) rows `kv_write_reference` stores first into the stores viewed
    [R * C, Hkv, D], or None. rows: the ring modulus (default R; see the module docstring).
    softcap: the logit soft-cap (0: none); sinks: one logit per query head [Hq], or None.
    max_q_len: the bound the caller promises on every q_len (the Triton path skips its prompt-chunk
    kernel under it); here a segment past it is a ContractError, so CPU tests catch a broken promise.
    rope: (cos, sin) [T, D]: q and write's k come unrotated and are rotated first (`batchkv.ops.rope`).
    live: int [1]: rows from live[0] on the Triton path never reads; here a segment there is a ContractError.
    Returns [T, Hq, Dv] in q's dtype; scale defaults to 1/sqrt(D). Not graph-capturable (host reads).

    >>> out = sdpa_varlen_reference(q, k, v, torch.tensor([[0, 3, 1, 3]], dtype=torch.int32))
    """
    q, write = (q, write) if rope is None else rotate_step(q, write, rope)
    if write is not None:
        kv_write_reference(k_store.view(-1, *k_store.shape[2:]), v_store.view(-1, *v_store.shape[2:]), *write,
                           k_scale, v_scale)  # fmt: skip
    num_tokens, num_q_heads, head_dim = q.shape
    columns, num_kv_heads = k_store.shape[1:3]
    rows = k_store.shape[0] if rows is None else rows
    group = num_q_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    out = torch.zeros(num_tokens, num_q_heads, v_store.shape[-1], dtype=torch.float32, device=q.device)
    for q_start, q_len, col, kv_end in _live_rows(seq_info, live, max_q_len):
        lo_resident = max(0, kv_end - rows)
        if lo_resident >= kv_end:
            continue
        t = torch.arange(lo_resident, kv_end, device=q.device)  # resident key positions
        slot = (t % rows) * columns + col
        at = (slot // columns, slot % columns)
        keys = _read(k_store, k_scale, at).repeat_interleave(group, dim=1)  # [N, Hq, D]
        values = _read(v_store, v_scale, at).repeat_interleave(group, dim=1)
        p = torch.arange(kv_end - q_len, kv_end, device=q.device)  # [q_len] query positions
        if causal:
            allowed = t[None, :] <= p[:, None]
            if window:
                allowed &= t[None, :] > p[:, None] - window
        else:
            allowed = torch.ones(q_len, t.numel(), dtype=torch.bool, device=q.device)
            if window:
                allowed &= (t >= kv_end - window)[None, :]
        queries = q[q_start : q_start + q_len].float()  # [q_len, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", queries, keys) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        if sinks is not None:  # the sink's column takes its share of the softmax, then is dropped
            sink = sinks.float().to(q.device)[:, None, None].expand(num_q_heads, q_len, 1)
            probs = torch.softmax(torch.cat([scores, sink], -1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row with no key gives zeros
        # Masked keys can hold NaN (never-written storage); zero them so 0 * NaN cannot leak.
        values = values.masked_fill(~allowed.any(0)[:, None, None], 0.0)
        out[q_start : q_start + q_len] = torch.einsum("hqk,khd->qhd", probs, values)
    return out.to(q.dtype)


def _live_rows(seq_info: torch.Tensor, live: torch.Tensor | None, max_q_len: int | None) -> list[list[int]]:
    """The table's rows with queries (a table sized by max_seqs is mostly empty rows); a ContractError when
    one sits at or past `live` (the rows the Triton path reads) or is longer than `max_q_len`."""
    first_dead = seq_info.shape[0] if live is None else int(live.reshape(-1)[0])
    if bool((seq_info[first_dead:, 1] > 0).any()):
        raise ContractError(f"sdpa_varlen_reference: a segment at or past row live={first_dead}")
    rows = seq_info[seq_info[:, 1] > 0].tolist()
    if max_q_len is not None and any(row[1] > max_q_len for row in rows):
        longest = max(row[1] for row in rows)
        raise ContractError(f"sdpa_varlen_reference: a segment of {longest} queries; max_q_len is {max_q_len}")
    return rows


def kv_write_reference(
    k_flat: torch.Tensor,
    v_flat: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write this step's K/V rows into the flat store views: `k_flat[slots[i]] = k[i]`.

    k_flat, v_flat: [rows * C, Hkv, D] and [rows * C, Hkv, Dv] views of the stores; k, v: [W, Hkv, D]
    and [W, Hkv, Dv]; slots: int64 [W].
    Cast to the store's dtype on write; e4m3 stores also take k_scale, v_scale, fp32 scale planes
    [rows, C, Hkv] (any strides), and get `quantize_fp8`'s codes and scales, the scale of slot s
    at [s // C, s % C]. Capturable (no host reads).
    """
    slots = slots.long()  # index_copy and index_put take int64 (int32 slots are allowed, as in kv_write)
    for flat, scale, x in ((k_flat, k_scale, k), (v_flat, v_scale, v)):
        if scale is None:
            index_copy(flat, slots, x.to(flat.dtype))
        else:
            codes, scales = quantize_fp8(x)
            index_copy(flat, slots, codes)
            columns = scale.shape[1]
            scale.index_put_((slots // columns, slots % columns), scales)


def index_copy(dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
    """`dst.index_copy_(0, index, src)`, for e4m3 tensors too (through uint8 views: torch has no
    e4m3 index_copy on the CPU)."""
    if dst.dtype == FP8:
        dst, src = dst.view(torch.uint8), src.view(torch.uint8)
    dst.index_copy_(0, index, src)
