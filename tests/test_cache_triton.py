"""The cache with attention="triton" gives what attention="reference" gives, step after step."""

from __future__ import annotations

import torch

from batchkv.cache.batch import BatchedSequenceCache
from batchkv.cache.config import CacheConfig, LayerSpec

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_triton_cache_matches_reference_cache_through_prefill_decode_and_ring_wrap():
    cfg = CacheConfig(
        num_layers=2, kv_heads=2, head_dim=16, max_seqs=3, capacity=64, max_write=8,
        layers=(LayerSpec(), LayerSpec("ring", window=12)), dtype=torch.float32,
    )  # fmt: skip
    assert cfg.ring_rows(1) == 19
    caches = [BatchedSequenceCache(cfg, DEVICE, attention=name) for name in ("triton", "reference")]
    assert caches[0].attention == "triton"
    ids, same = ((c.seq_new(), c.seq_new()) for c in caches)
    assert ids == same
    gen = torch.Generator().manual_seed(0)
    steps = [  # (packed ids, width, causal)
        ([0] * 8 + [1] * 5, 16, True),  # prefill
        ([0, 1], 4, True),  # decode, padded
        ([0] * 8 + [1], 9, True),  # a chunk and a decode
        ([1] * 4 + [0], 6, False),  # a draft block, non-causal
        ([0, 1], 2, True),  # sequence 0 is now past the ring's 19 rows
        ([1, 0], 3, True),
    ]
    for packed, width, causal in steps:
        q = torch.randn(width, 4, 16, generator=gen).to(DEVICE)
        k, v = torch.randn(2, width, 2, 16, generator=gen).to(DEVICE)
        outs = []
        for cache in caches:
            cache.declare_step([ids[i] for i in packed])
            cache.prepare_step(width)
            outs.append([cache.update_and_attend(layer, q, k, v, causal=causal) for layer in range(2)])
            cache.commit_step()
        for got, want in zip(*outs, strict=True):
            torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
            assert torch.equal(got[len(packed) :], torch.zeros_like(got[len(packed) :]))
    assert caches[0].pos(ids[0]) == 20 and caches[0].pos(ids[0]) > cfg.ring_rows(1)
