"""sdpa_varlen over a pool of extents ([P, 1, Hkv, D], `col` an extent's first row, `rows` the ring
modulus) on every path (split decode, verify blocks, prompt chunks, split_merge, e4m3), under the
interpreter on CPU, against the torch reference and an SDPA oracle over each sequence's own keys.

The pool starts as NaN; only rows inside an extent that hold a position its sequence may read are
filled, so a kernel that reads past an extent (a neighbour's rows or a hole) turns its output NaN.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from batchkv.ops import sdpa_varlen_reference
from batchkv.ops.reference import dequantize_fp8, quantize_fp8
from batchkv.ops.sdpa.launch import SdpaConfig, sdpa_varlen
from batchkv.ops.support import FP8, empty_scales

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HKV, GROUP, D = 2, 4, 32


def pool_case(segments, *, modulus, pool=200, seed=0, quantized=False):
    """q, the pool's K/V (and e4m3 scales), seq_info, and each segment's keys in position order.

    segments: (q_len, base, extent rows, kv_end); position p of a sequence sits at row
    base + p % extent rows (an extent shorter than `modulus` never wraps: kv_end <= its rows).
    """
    gen = torch.Generator().manual_seed(seed)
    k = torch.full((pool, 1, HKV, D), float("nan"))
    v = torch.full_like(k, float("nan"))
    table, keys, q_start = [], [], 0
    for q_len, base, rows, kv_end in segments:
        assert rows == modulus or kv_end <= rows
        lo = max(0, kv_end - rows)
        ks, vs = (torch.randn(kv_end - lo, HKV, D, generator=gen) for _ in range(2))
        for i, t in enumerate(range(lo, kv_end)):
            k[base + t % rows, 0], v[base + t % rows, 0] = ks[i], vs[i]
        keys.append((lo, ks, vs))
        table.append((q_start, q_len, base, kv_end))
        q_start += q_len
    q = torch.randn(q_start + 2, HKV * GROUP, D, generator=gen)  # 2 uncovered rows
    info = torch.tensor(table, dtype=torch.int32)
    scales = None
    if quantized:
        codes, scale = zip(*(quantize_fp8(x.nan_to_num(0.0)) for x in (k, v)), strict=True)  # holes: zeros
        scales = []
        for s, x in zip(scale, (k, v), strict=True):
            plane = empty_scales(pool, 1, HKV).copy_(s)
            plane[x.isnan().all(-1)] = float("nan")  # holes stay poisoned (their scale is NaN)
            scales.append(plane.to(DEVICE))
        k, v = codes
        keys = [(lo, *(dequantize_fp8(*quantize_fp8(x)) for x in (ks, vs))) for lo, ks, vs in keys]
    return q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), info.to(DEVICE), keys, scales


def oracle(q, info, keys, *, causal=True, window=0) -> torch.Tensor:
    """Each segment's queries over its own keys (positions lo..kv_end-1) with SDPA, fp32."""
    out = torch.zeros(q.shape, dtype=torch.float32)
    for (q_start, q_len, _, kv_end), (lo, ks, vs) in zip(info.tolist(), keys, strict=True):
        t = torch.arange(lo, kv_end)
        p = torch.arange(kv_end - q_len, kv_end)
        allowed = (t[None] <= p[:, None]) if causal else torch.ones(q_len, t.numel(), dtype=torch.bool)
        if window:
            allowed &= (t[None] > p[:, None] - window) if causal else (t >= kv_end - window)[None]
        qs = q[q_start : q_start + q_len].float().cpu().transpose(0, 1)  # [Hq, q_len, D]
        kk = ks.float().transpose(0, 1).repeat_interleave(GROUP, 0)
        vv = vs.float().transpose(0, 1).repeat_interleave(GROUP, 0)
        out[q_start : q_start + q_len] = F.scaled_dot_product_attention(qs, kk, vv, attn_mask=allowed[None]).transpose(
            0, 1
        )
    return out


SEGMENTS = [(1, 10, 37, 37), (1, 60, 5, 5), (3, 70, 64, 50), (1, 140, 41, 41)]  # decode, decode, verify, decode
PROMPT = [(24, 0, 40, 40), (1, 100, 90, 77), (20, 40, 60, 20)]  # prompt chunks beside a decode row


@pytest.mark.parametrize("segments", [SEGMENTS, PROMPT], ids=["decode-verify", "prompt-chunks"])
@pytest.mark.parametrize("config", [None, SdpaConfig(split_merge=True)], ids=["default", "split_merge"])
def test_a_pool_of_extents_gives_each_sequence_its_own_keys_on_every_path(segments, config):
    q, k, v, info, keys, _ = pool_case(segments, modulus=128)
    out = sdpa_varlen(q, k, v, info, rows=128, config=config, out=torch.full_like(q, float("nan")))
    ref = sdpa_varlen_reference(q, k, v, info, rows=128)
    covered = info[:, 1].sum()
    assert not out.isnan().any() and torch.equal(out[covered:], torch.zeros_like(out[covered:]))
    torch.testing.assert_close(out.cpu(), ref.cpu(), atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(out.cpu(), oracle(q, info, keys), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("window", [0, 6])
def test_ring_extents_wrap_at_the_ring_and_shorter_ones_never_wrap(window):
    # ring of 12 rows: one sequence past it (31 positions, wrapped), one that never reached it (7 rows)
    segments = [(1, 3, 12, 31), (2, 50, 7, 7), (1, 20, 12, 12)]
    q, k, v, info, keys, _ = pool_case(segments, modulus=12)
    out = sdpa_varlen(q, k, v, info, rows=12, window=window, out=torch.full_like(q, float("nan")))
    assert not out.isnan().any()
    torch.testing.assert_close(out.cpu(), oracle(q, info, keys, window=window), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("segments", [SEGMENTS, PROMPT], ids=["decode-verify", "prompt-chunks"])
def test_an_e4m3_pool_reads_each_extents_codes_and_scales(segments):
    q, k, v, info, keys, (ks, vs) = pool_case(segments, modulus=128, quantized=True)
    q16 = q.to(torch.float16)
    out = sdpa_varlen(q16, k, v, info, rows=128, k_scale=ks, v_scale=vs, config=SdpaConfig(e4m3_qk_long=False))
    assert not out.isnan().any()
    torch.testing.assert_close(out.float().cpu(), oracle(q16, info, keys), atol=3e-3, rtol=1e-2)
    assert k.dtype == FP8
