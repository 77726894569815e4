"""The package-internal hooks the single-sequence facade uses: `_load_prefix` and `_set_length`.

Each is followed by ordinary steps checked against the naive SDPA oracle (tests/oracle.py), whose
history is set to what the hook promises the sequence holds.
"""

from __future__ import annotations

import pytest
import torch

from batchkv import BatchedSequenceCache, CacheConfig, LayerSpec
from batchkv.errors import CapacityError, ContractError, RingFloorError, StepError
from tests.oracle import Pair


def make_pair(max_seqs: int = 2, capacity: int = 64, buckets=(8, 16, 64)) -> Pair:
    cfg = CacheConfig(
        num_layers=2,
        kv_heads=2,
        head_dim=8,
        max_seqs=max_seqs,
        capacity=capacity,
        max_write=2,
        layers=(LayerSpec("flat"), LayerSpec("ring", window=4)),
        dtype=torch.float32,
        buckets=buckets,
    )
    return Pair(BatchedSequenceCache(cfg, "cpu", attention="reference"), seed=1)


def load(pair: Pair, seq: int, n: int) -> None:
    """`_load_prefix` n random positions into seq, and the same history into the oracle."""
    cfg = pair.cache.config
    keys = [pair.randn(n, cfg.kv_heads, cfg.head_dim) for _ in range(cfg.num_layers)]
    values = [pair.randn(n, cfg.kv_heads, cfg.head_dim) for _ in range(cfg.num_layers)]
    pair.cache._load_prefix(seq, keys, values)
    pair.naive.k[seq] = [list(k.unbind(0)) for k in keys]
    pair.naive.v[seq] = [list(v.unbind(0)) for v in values]


def state(cache: BatchedSequenceCache) -> tuple:
    stores = [(cache.k_store(i).clone(), cache.v_store(i).clone()) for i in range(cache.config.num_layers)]
    reaches = {seq: cache.reach(seq) for seq in cache.sequences}
    return dict(cache._lengths), dict(cache._high_water), cache.generation, reaches, stores


def assert_same(before: tuple, after: tuple) -> None:
    assert before[:4] == after[:4]
    for (k0, v0), (k1, v1) in zip(before[4], after[4], strict=True):
        assert torch.equal(k0.nan_to_num(), k1.nan_to_num()) and torch.equal(v0.nan_to_num(), v1.nan_to_num())


def test_a_loaded_prefix_is_attended_like_a_decoded_one_beside_a_neighbour():
    pair = make_pair()
    a, b = pair.new(), pair.new()
    pair.step([b, b])
    load(pair, a, 11)  # past the 8-row bucket and past the ring's 5 rows
    assert pair.cache.pos(a) == 11 and pair.cache.reach(a) == 16
    for _ in range(3):
        pair.step([a, b])
    pair.step([a, a, b])


def test_loading_over_a_longer_history_replaces_it():
    pair = make_pair()
    a = pair.new()
    for _ in range(6):
        pair.step([a, a])
    load(pair, a, 3)
    assert pair.cache.pos(a) == 3 and pair.cache.ring_floor(a) == 0
    pair.step([a])
    pair.step([a, a])


def test_a_refused_load_changes_nothing():
    pair = make_pair(capacity=32, buckets=(8, 32))
    a = pair.new()
    pair.step([a, a])
    cache, before = pair.cache, state(pair.cache)
    good = [torch.randn(4, 2, 8) for _ in range(2)]
    bad_heads = [torch.randn(4, 3, 8) for _ in range(2)]
    too_long = [torch.randn(33, 2, 8) for _ in range(2)]
    for keys, values, error in (
        (good[:1], good, ContractError),
        (good, bad_heads, ContractError),
        (too_long, too_long, CapacityError),
    ):
        with pytest.raises(error):
            cache._load_prefix(a, keys, values)
        assert_same(before, state(cache))
    pair.step([a])


def test_a_forward_length_keeps_what_the_rows_hold():
    pair = make_pair()
    a = pair.new()
    for _ in range(3):
        pair.step([a, a])
    keys = [list(layer) for layer in pair.naive.k[a]]
    values = [list(layer) for layer in pair.naive.v[a]]
    pair.rewind(a, 4)
    pair.cache._set_length(a, 6)  # positions 4 and 5 were written and are still resident
    pair.naive.k[a], pair.naive.v[a] = keys, values
    pair.step([a, a])
    pair.cache._set_length(a, 7)  # back: the rewind rules apply (floor 8 - 2)
    pair.naive.rewind(a, 7)
    pair.step([a])


def test_a_forward_length_past_the_rows_or_below_the_ring_floor_is_refused_and_changes_nothing():
    pair = make_pair()
    a = pair.new()
    for _ in range(4):
        pair.step([a, a])  # 8 positions in 8 rows; the ring (5 rows) has wrapped: floor 6
    cache, before = pair.cache, state(pair.cache)
    with pytest.raises(CapacityError, match="reserve"):
        cache._set_length(a, 9)
    with pytest.raises(RingFloorError):
        cache._set_length(a, 5)
    assert_same(before, state(cache))
    pair.step([a])


def test_moving_a_declared_sequence_asks_for_prepare_again():
    pair = make_pair()
    a = pair.new()
    pair.step([a, a])
    cache = pair.cache
    cache.declare_step([a])
    cache.prepare_step(1)
    cache._set_length(a, 1)
    with pytest.raises(StepError, match="prepare"):
        cache.update_and_attend(0, torch.randn(1, 4, 8), torch.randn(1, 2, 8), torch.randn(1, 2, 8))
    pair.naive.rewind(a, 1)
    pair.step([a])
