"""The long path's TMA loads (SdpaConfig.tma_long) and the e4m3 prompt tiles, under the interpreter on CPU.

With TMA the long path reads its unmasked key blocks through two host descriptors over the stores
viewed [R, C * Hkv * D]; masked blocks, and interiors that wrap the ring, keep pointer loads. The
cases are the contract's awkward ones on NaN-poisoned stores (odd lengths, windows over wrapped
rings, non-causal rows, GQA 1-8, head dims 16-128, a pool of extents, e4m3 codes); a tile read
through the descriptors is the same tile, so TMA on and off must agree exactly.
"""

from __future__ import annotations

import pytest
import torch

import batchkv.ops.sdpa.launch as triton_ops
from batchkv.ops import sdpa_varlen_reference
from batchkv.ops.sdpa.launch import SdpaConfig, resolve_config, sdpa_varlen, tma_views
from tests.test_fp8_qk_long import run as qk_run
from tests.test_sdpa_varlen import check, make_case
from tests.test_sdpa_varlen_pool import PROMPT, oracle, pool_case

TILES = dict(block_m_long=32, block_n_long=16)  # small tiles: several interior blocks at small shapes
TMA, POINTERS = SdpaConfig(tma_long=True, **TILES), SdpaConfig(tma_long=False, **TILES)

CASES = {  # name: (segments (q_len, col, kv_end), keyword arguments of `check`)
    "prompt chunks after histories": ([(40, 1, 40), (37, 0, 113), (1, 2, 9)], dict(rows=120, head_dim=16)),
    "odd lengths, GQA 8": ([(33, 0, 201), (19, 3, 19), (70, 1, 77)], dict(rows=256, group=8, kv_heads=1)),
    "no GQA, 8 KV heads": ([(50, 2, 90), (17, 4, 60)], dict(rows=96, group=1, kv_heads=8)),
    "window over a wrapped ring": ([(40, 1, 150), (37, 2, 300), (20, 0, 64)], dict(rows=64, window=50)),
    "ring wrapped, no window": ([(30, 1, 100), (18, 0, 45)], dict(rows=48)),
    "non-causal": ([(40, 1, 150), (37, 2, 300)], dict(rows=320, causal=False)),
    "head_dim 64": ([(36, 0, 80), (20, 1, 20)], dict(rows=96, head_dim=64, kv_heads=1)),
    "head_dim 128, gaps": ([(24, 0, 70), (18, 1, 18)], dict(rows=80, head_dim=128, kv_heads=1, gap=3)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_tma_loads_match_the_reference_and_pointer_loads_exactly(name):
    segments, case = CASES[name][0], dict(CASES[name][1])
    masks = {key: case.pop(key) for key in ("causal", "window") if key in case}
    out, _ = check(segments, config=TMA, **masks, **case)  # against the reference, uncovered rows zero, no NaN
    (q, k, v), info = make_case(segments, **case)
    assert torch.equal(out, sdpa_varlen(q, k, v, info, config=POINTERS, **masks))


def test_the_interior_is_read_through_the_descriptors(monkeypatch):
    # descriptors over zero stores: the unmasked blocks (the first 64 keys of the 100-key history)
    # then score 0 and add nothing, so the output moves off the reference; pointer loads never ask
    segments, case = [(20, 0, 100)], dict(rows=128, kv_heads=1)
    (q, k, v), info = make_case(segments, **case)
    ref = sdpa_varlen_reference(q, k, v, info)
    monkeypatch.setattr(triton_ops, "tma_views", lambda k, v, n: tma_views(torch.zeros_like(k), torch.zeros_like(v), n))
    torch.testing.assert_close(sdpa_varlen(q, k, v, info, config=POINTERS), ref, atol=2e-5, rtol=1e-4)
    wrong = sdpa_varlen(q, k, v, info, config=TMA)
    assert (wrong - ref).abs().max() > 0.1


def test_stores_tma_cannot_serve_fall_back_to_pointer_loads():
    (q, k, v), info = make_case([(30, 1, 90), (20, 0, 20)], rows=96)
    ref = sdpa_varlen_reference(q, k, v, info)

    def strided(x):  # key rows 64 apart: one head's D elements, then 32 unused
        return torch.full((96, 6, 2, 64), float("nan"), device=x.device)[..., :32].copy_(x)

    def shifted(x):  # a base 4 bytes past a 16-byte boundary
        return torch.full((x.numel() + 1,), float("nan"), device=x.device)[1:].view(x.shape).copy_(x)

    for layout in (strided, shifted):
        k2, v2 = layout(k), layout(v)
        assert tma_views(k2, v2, 16) is None
        torch.testing.assert_close(sdpa_varlen(q, k2, v2, info, config=TMA), ref, atol=2e-5, rtol=1e-4)
    descs = tma_views(k, v, 16)
    assert descs is not None and list(descs[0].shape) == [96, 6 * 2 * 32] and list(descs[0].block_shape) == [16, 32]


def test_a_pool_of_extents_reads_each_extent_through_the_descriptors():
    q, k, v, info, keys, _ = pool_case(PROMPT, modulus=128)  # chunks of 24 and 20 tokens beside a decode row
    out = sdpa_varlen(q, k, v, info, rows=128, config=TMA, out=torch.full_like(q, float("nan")))
    assert not out.isnan().any()
    torch.testing.assert_close(out.cpu(), oracle(q, info, keys), atol=2e-5, rtol=1e-4)
    assert torch.equal(out, sdpa_varlen(q, k, v, info, rows=128, config=POINTERS))


@pytest.mark.parametrize("exact_q", [False, True], ids=["e4m3-dots", "exact-queries"])
def test_e4m3_prompt_chunks_read_codes_through_the_descriptors_as_pointers_do(exact_q):
    # QK^T an e4m3 dot of rounded queries on K's codes as loaded, or K converted (exact queries);
    # against the reference fed the same queries, and TMA on and off exactly equal
    qk = dict(e4m3_qk_long=not exact_q, **TILES)
    segments = [(40, 1, 150), (37, 2, 300), (1, 0, 30)]  # a window over a wrapped ring for the second
    runs = [qk_run(segments, rows=200, window=120, head_dim=32, config=SdpaConfig(tma_long=tma, **qk))
            for tma in (True, False)]  # fmt: skip
    (out, ref, exact, v_max, covered, _), (pointers, *_) = runs
    long = covered == 2
    torch.testing.assert_close(out[long], (exact if exact_q else ref)[long], atol=2**-9 * v_max.item(), rtol=1e-3)
    assert not out.isnan().any() and torch.equal(out, pointers)


def test_e4m3_stores_with_16_bit_queries_choose_the_e4m3_prompt_tiles_and_tma():
    cpu = torch.device("cpu")
    e4m3 = resolve_config(None, 128, torch.float8_e4m3fn, 8, cpu, True)
    assert (e4m3.block_m_long, e4m3.block_n_long, e4m3.num_warps_long, e4m3.num_stages_long) == (64, 128, 4, 2)
    assert e4m3.tma_long is True
    for dtype, half in ((torch.float8_e4m3fn, False), (torch.bfloat16, True)):  # fp32 queries; 16-bit stores
        other = resolve_config(None, 128, dtype, 8, cpu, half)
        assert (other.block_m_long, other.block_n_long, other.num_warps_long, other.num_stages_long) == (128, 64, 8, 3)
        assert other.tma_long is False
    wide = resolve_config(None, 256, torch.float8_e4m3fn, 8, cpu, True)  # 256-code rows keep the wide tiles
    assert (wide.block_m_long, wide.block_n_long, wide.num_stages_long, wide.tma_long) == (64, 32, 2, False)
    mine = resolve_config(SdpaConfig(block_n_long=32, tma_long=False), 128, torch.float8_e4m3fn, 8, cpu, True)
    assert (mine.block_n_long, mine.block_m_long, mine.tma_long) == (32, 64, False)  # set fields are kept
