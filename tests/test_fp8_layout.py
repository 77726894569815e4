"""e4m3 scale planes in the store's layout: logically [P, 1, Hkv] (row first, like K and V), stored
[1, Hkv, P], so one sequence's (an extent of consecutive rows) positions are contiguous per KV head
for the attention kernels.

Every plane is allocated NaN-poisoned (NaN codes and scales), so a scale written to the wrong place,
or a read of one never written, shows up as NaN in the oracle comparisons or in the storage checks.
"""

from __future__ import annotations

import pytest
import torch

from batchkv import BatchedSequenceCache, CacheConfig, LayerSpec
from batchkv.cache.store import ColumnStore
from batchkv.ops.reference import dequantize_fp8, kv_write_reference, quantize_fp8
from batchkv.ops.support import FP8, SCALE_PLANES
from tests.oracle import Pair

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def poisoned(shape, dtype, device):
    """The store's allocator, NaN everywhere (e4m3 code 0x7F)."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def storage(plane: torch.Tensor) -> torch.Tensor:
    """A scale plane [P, 1, Hkv] as its storage holds it, [1, Hkv, P] (contiguous in the store's layout)."""
    return plane.permute(1, 2, 0)


def assert_rows_last(cache_or_store) -> None:
    store = getattr(cache_or_store, "_store", cache_or_store)
    cfg = store.config
    for layer in range(cfg.num_layers):
        planes = store.layer(layer)
        rows = planes["k"].shape[0]
        for name in SCALE_PLANES:
            plane = planes[name]
            assert plane.shape == (rows, 1, cfg.kv_heads), (layer, name)
            assert storage(plane).is_contiguous(), (layer, name, plane.stride())


@pytest.mark.parametrize("attention", ["reference", "triton"])
def test_scale_planes_stay_rows_last_through_growth_a_full_ring_and_clones_and_match_the_oracle(attention):
    cfg = CacheConfig(num_layers=2, kv_heads=2, head_dim=16, max_seqs=3, capacity=64, max_write=3,
                      layers=(LayerSpec(), LayerSpec("ring", window=4)), dtype=torch.float32, kv_dtype=FP8,
                      buckets=(8, 16), tail_step=16)  # fmt: skip
    pair = Pair(BatchedSequenceCache(cfg, DEVICE, attention=attention, alloc=poisoned))
    assert_rows_last(pair.cache)
    a, b = pair.new(), pair.new()
    pair.step([a, a, a, b, b], width=6)
    generation = pair.cache.generation
    for _ in range(4):
        pair.step([a, a, a, b])  # a passes 8 rows: the flat layer grows, the full ring (6 rows) stays
    assert pair.cache.generation > generation and pair.cache.reach(a) == 16
    assert pair.cache.column(a, 1)["k"].shape[0] == 6
    assert_rows_last(pair.cache)
    c = pair.clone(a, upto=13)
    pair.step([c, a, b])
    pair.step([b, b, c], causal=False)
    assert_rows_last(pair.cache)


@pytest.mark.parametrize("write", ["reference", "triton"])
def test_the_store_puts_each_scale_at_its_extent_head_and_position_through_writes_clones_and_moves(write):
    cfg = CacheConfig(num_layers=1, kv_heads=2, head_dim=16, max_seqs=3, capacity=64, max_write=2,
                      dtype=torch.float32, kv_dtype=FP8, buckets=(8, 32))  # fmt: skip
    store = ColumnStore(cfg, torch.device(DEVICE), alloc=poisoned)
    assert_rows_last(store)
    store.place(1, 8)
    store.place(3, 8)
    b1, b3 = store.base(0, 1), store.base(0, 3)
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(6, 2, 16, generator=gen) * torch.logspace(-3, 3, 6)[:, None, None]
    v = torch.randn(6, 2, 16, generator=gen)
    store.write_column(1, 0, k, v)  # positions 0..5 of sequence 1
    (_, k_scale), (_, v_scale) = quantize_fp8(k), quantize_fp8(v)  # [6, Hkv]
    want = {"k_scale": k_scale.T.to(DEVICE), "v_scale": v_scale.T.to(DEVICE)}  # [Hkv, 6]: per head, by position

    def untouched(raw: torch.Tensor, *written: tuple[int, int]) -> bool:
        """Every row of raw [1, Hkv, P] outside the `written` (start, stop) ranges is still NaN."""
        keep = torch.ones(raw.shape[2], dtype=torch.bool, device=raw.device)
        for start, stop in written:
            keep[start:stop] = False
        return bool(raw[:, :, keep].isnan().all())

    for name in SCALE_PLANES:
        raw = storage(store.layer(0)[name])  # [1, Hkv, P]
        assert torch.equal(raw[0, :, b1 : b1 + 6], want[name]) and untouched(raw, (b1, b1 + 6))

    # the step's write: one token at position 6 of sequence 1 (slot b1 + 6), one at position 0 of 3
    k_new = torch.randn(2, 2, 16, generator=gen).to(DEVICE)
    v_new = torch.randn(2, 2, 16, generator=gen).to(DEVICE)
    slots = torch.tensor([b1 + 6, b3], device=DEVICE)
    views = store.write_views(0)
    if write == "triton":
        from batchkv.ops.kv_write_triton import kv_write
    else:
        kv_write = kv_write_reference
    kv_write(views["k"], views["v"], k_new, v_new, slots, k_scale=views["k_scale"], v_scale=views["v_scale"])
    for name, x in (("k_scale", k_new), ("v_scale", v_new)):
        raw = storage(store.layer(0)[name])
        scales = quantize_fp8(x)[1]  # [2, Hkv]
        assert torch.equal(raw[0, :, b1 + 6], scales[0]) and torch.equal(raw[0, :, b3], scales[1])
        assert untouched(raw, (b1, b1 + 7), (b3, b3 + 1))

    store.place(2, 8)
    b2 = store.base(0, 2)
    store.copy_prefix(1, 2, 4)  # a clone of sequence 1's first 4 positions
    for name in SCALE_PLANES:
        raw = storage(store.layer(0)[name])
        assert torch.equal(raw[0, :, b2 : b2 + 4], raw[0, :, b1 : b1 + 4])
        assert untouched(raw, (b1, b1 + 7), (b3, b3 + 1), (b2, b2 + 4))

    held = {1: (b1, 7), 3: (b3, 1), 2: (b2, 4)}  # sequence -> (base, positions written)
    before = {(seq, name): storage(store.layer(0)[name])[0, :, b : b + n].clone() for seq, (b, n) in held.items()
              for name in SCALE_PLANES}  # fmt: skip
    store.resize({1: 32}, keep={1: 7})  # no room after it: the pool grows and the extents above it move up
    assert store.rows(0, 1) == 32 and store.base(0, 3) != b3
    assert_rows_last(store)
    for (seq, name), old in before.items():
        base, n = store.base(0, seq), held[seq][1]
        assert torch.equal(storage(store.layer(0)[name])[0, :, base : base + n], old)  # moved with its extent
    got_k, got_v = store.read_column(1, 0, 6)
    torch.testing.assert_close(got_k.cpu(), dequantize_fp8(*quantize_fp8(k)), rtol=0, atol=0)
    torch.testing.assert_close(got_v.cpu(), dequantize_fp8(*quantize_fp8(v)), rtol=0, atol=0)
