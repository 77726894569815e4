"""BatchControl behaviour, each test checked against the naive SDPA oracle in tests/oracle.py."""

from __future__ import annotations

import pytest
import torch

from batchkv import BatchedSequenceCache, CacheConfig, LayerSpec
from batchkv.errors import CapacityError, RingFloorError, StepError
from tests.oracle import Pair


def make_pair(
    layers=(LayerSpec("flat"), LayerSpec("ring", window=4)),
    max_seqs: int = 4,
    capacity: int = 64,
    max_write: int = 3,
    seed: int = 0,
    **kw,
) -> Pair:
    cfg = CacheConfig(
        num_layers=len(layers),
        kv_heads=2,
        head_dim=8,
        max_seqs=max_seqs,
        capacity=capacity,
        max_write=max_write,
        layers=tuple(layers),
        dtype=torch.float32,
        **kw,
    )
    return Pair(BatchedSequenceCache(cfg, "cpu", attention="reference"), seed=seed)


def base(cache: BatchedSequenceCache, seq: int, group: int = 0) -> int:
    """First row of `seq`'s extent in a layer group's pool (the `col` of its segments)."""
    return cache._store.base(group, seq)


def decode(pair: Pair, seqs: list[int], steps: int) -> None:
    for _ in range(steps):
        pair.step(list(seqs))


def test_spans_of_several_sequences_match_each_run_alone():
    pair = make_pair()
    a, b, c = pair.new(), pair.new(), pair.new()
    pair.step([a, a, a, b, c, c], width=8)
    pair.step([b, b, c, a], width=4)


def test_decode_continues_each_private_history():
    pair = make_pair(capacity=32)
    a, b = pair.new(), pair.new()
    pair.step([a, a, a, b, b])
    decode(pair, [a, b], 12)
    assert pair.cache.pos(a) == 15 and pair.cache.pos(b) == 14


def test_a_sequence_spanned_twice_in_one_step_continues_across_both_runs():
    pair = make_pair()
    a, b = pair.new(), pair.new()
    pair.step([a, b])
    pair.step([a, a, b, a], width=5)
    assert pair.cache.pos(a) == 4
    info = pair.cache.seq_info[:3].tolist()
    col_a, col_b = base(pair.cache, a), base(pair.cache, b)  # `col` is the extent's first row
    assert info == [[0, 2, col_a, 3], [2, 1, col_b, 2], [3, 1, col_a, 4]]


def test_a_ring_layer_wraps_while_a_neighbour_decodes():
    pair = make_pair(layers=(LayerSpec("ring", window=4), LayerSpec("flat", window=3)))
    a, b = pair.new(), pair.new()
    pair.step([a, a, a, b])
    decode(pair, [a, b], 10)  # ring rows = 4 + 3 - 1 = 6; both sequences pass them
    pair.step([a, a, a, b])
    assert pair.cache.column(a, 0)["k"].shape[0] == pair.cache.column(b, 0)["k"].shape[0] == 6


def test_clone_copies_the_prefix_then_diverges_on_different_tokens():
    pair = make_pair()
    a = pair.new()
    pair.step([a, a, a])
    decode(pair, [a], 3)
    b = pair.clone(a)
    assert pair.cache.pos(b) == 6
    decode(pair, [a, b], 4)  # random, different K/V for each: a shared store would diverge from the oracle


def test_partial_clone_copies_only_the_prefix():
    pair = make_pair(layers=(LayerSpec("flat"), LayerSpec("flat")))
    a = pair.new()
    pair.step([a, a, a])
    decode(pair, [a], 4)
    b = pair.clone(a, upto=3)
    assert pair.cache.pos(b) == 3
    decode(pair, [b, a], 3)


def test_clone_of_a_wrapped_ring_keeps_the_window():
    pair = make_pair()  # ring window 4, max_write 3 -> 6 rows
    a = pair.new()
    pair.step([a, a, a])
    decode(pair, [a], 10)  # written 13 > 6 rows: wrapped, floor 10
    b = pair.clone(a, upto=11)
    decode(pair, [a, b], 3)


def test_a_fork_of_a_fork_keeps_the_donors_floor():
    pair = make_pair()
    a = pair.new()
    pair.step([a, a, a])
    decode(pair, [a], 18)  # 21 written, floor 18
    b = pair.clone(a, upto=19)
    assert pair.cache.ring_floor(b) == 18
    with pytest.raises(RingFloorError):
        pair.cache.seq_clone(b, upto=17)
    c = pair.clone(b, upto=18)
    assert pair.cache.ring_floor(c) == 18
    decode(pair, [c], 2)


def test_rewind_then_continue_equals_an_unbroken_run():
    pair = make_pair()
    a = pair.new()
    pair.step([a, a, a])
    decode(pair, [a], 4)
    pair.rewind(a, 5)
    decode(pair, [a], 4)
    pair.step([a, a, a])


def test_rewind_refuses_to_grow_or_to_pass_the_ring_floor():
    pair = make_pair()  # w4 / max_write 3 -> ring of 6 rows
    a = pair.new()
    for _ in range(7):
        pair.step([a, a, a])  # 21 written
    with pytest.raises(CapacityError.__mro__[1]):  # any BatchKVError
        pair.cache.rewind(a, 22)
    with pytest.raises(RingFloorError):
        pair.cache.rewind(a, 17)
    pair.rewind(a, 18)
    pair.step([a, a, a])


def test_an_unwrapped_ring_can_be_rewound_to_zero():
    pair = make_pair()
    a = pair.new()
    pair.step([a, a, a])
    pair.step([a, a])
    assert pair.cache.ring_floor(a) == 0
    pair.rewind(a, 0)
    pair.step([a, a, a])


def test_seq_rm_invalidates_a_declared_step():
    pair = make_pair()
    a, b = pair.new(), pair.new()
    pair.cache.declare_step([a, b])
    pair.cache.seq_rm(b)
    with pytest.raises(StepError):
        pair.cache.prepare_step(2)
    pair.cache.declare_step([a])
    pair.cache.prepare_step(1)


def test_seq_rm_of_a_prepared_sequence_drops_the_step():
    pair = make_pair()
    a, b = pair.new(), pair.new()
    pair.cache.declare_step([a, b])
    pair.cache.prepare_step(2)
    pair.cache.seq_rm(a)
    with pytest.raises(StepError):
        pair.cache.commit_step()
    assert pair.cache.pos(b) == 0


def test_a_removed_id_is_reused_and_starts_at_zero():
    pair = make_pair()
    a, b = pair.new(), pair.new()
    pair.step([a, a, b])
    pair.rm(a)
    c = pair.new()
    assert c == a and pair.cache.pos(c) == 0
    pair.step([c, b, c])  # the old history in that column must not leak into the new sequence


def test_padding_rows_are_zero_and_never_touch_live_columns():
    pair = make_pair()
    cache = pair.cache
    a, b = pair.new(), pair.new()
    pair.step([a, a, b])
    live = {(base(cache, a, g) + r, g) for g in range(2) for r in range(2)}  # positions 0, 1 of a
    live |= {(base(cache, b, g), g) for g in range(2)}  # position 0 of b
    scratch = {(base(cache, "scratch", g) + r, g) for g in range(2) for r in range(cache.config.scratch_rows)}
    groups = cache._store.group_of
    for layer in range(2):  # poison every row not yet written, the scratch rows included
        for store in (cache.k_store(layer), cache.v_store(layer)):
            for row in range(store.shape[0]):
                if (row, groups[layer]) not in live:
                    store[row] = float("nan")
    before = [cache.k_store(layer).clone() for layer in range(2)]
    pair.step([a, b], width=8)  # 6 padding rows write into the scratch rows
    for layer in range(2):
        g, after = groups[layer], cache.k_store(layer)
        same = (after == before[layer]) | (after.isnan() & before[layer].isnan())
        changed = {row for row in (~same).any(dim=(1, 2, 3)).nonzero().flatten().tolist() if (row, g) not in scratch}
        assert changed == {base(cache, a, g) + 2, base(cache, b, g) + 1}
        rows = [row for row, group in scratch if group == g]
        assert not after[rows].isnan().all(), "padding rows were written to the scratch rows"


def test_a_non_causal_block_sees_itself_both_ways():
    pair = make_pair(layers=(LayerSpec("flat"), LayerSpec("flat", window=3)))
    a, b = pair.new(), pair.new()
    pair.step([a, a, b, b])
    pair.step([a, a, a, b, b], causal=False)


def test_a_non_causal_step_refuses_a_sequence_split_in_two_runs():
    pair = make_pair()
    a, b = pair.new(), pair.new()
    pair.cache.declare_step([a, b, a])
    pair.cache.prepare_step(3)
    x = torch.zeros(3, 2, 8)
    with pytest.raises(StepError):
        pair.cache.update_and_attend(0, torch.zeros(3, 4, 8), x, x, causal=False)


def test_growth_keeps_history_moves_only_the_sequence_that_grows_and_bumps_generation_with_the_pool():
    pair = make_pair(capacity=1024, max_write=8, buckets=(8, 16, 64), tail_step=64)
    cache = pair.cache
    a, b = pair.new(), pair.new()
    assert cache.reach(a) == cache.reach(b) == 8
    generation = cache.generation
    pair.step([a] * 6 + [b] * 2)
    pair.step([a] * 4 + [b])  # a reaches 10 > 8 rows
    assert cache.reach(a) == 16 and cache.reach(b) == 8  # memory follows each sequence's own length
    for _ in range(8):
        pair.step([a] * 8)  # 74: through 64 into the tail step
    assert cache.reach(a) == 128 and cache.reach(b) == 8
    assert cache.generation > generation  # the pool grew (storage moved) on the way
    decode(pair, [a, b], 2)
    assert cache.column(a, 1)["k"].shape[0] == 4 + 8 - 1  # the ring extent stopped at its full size
    assert cache.column(b, 1)["k"].shape[0] == 8  # a short sequence's ring extent never reached it


def test_an_allocation_that_fails_part_way_through_growth_leaves_the_cache_as_it_was():
    calls = {"n": 0, "fail_at": None}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["fail_at"] is not None and calls["n"] == calls["fail_at"]:
            raise torch.OutOfMemoryError("injected")
        return torch.empty(*args, **kwargs)

    cfg = CacheConfig(
        num_layers=3, kv_heads=2, head_dim=8, max_seqs=2, capacity=64, max_write=8, dtype=torch.float32, buckets=(8, 64)
    )
    pair = Pair(BatchedSequenceCache(cfg, "cpu", attention="reference", alloc=flaky))
    a = pair.new()
    pair.step([a] * 6)
    before = [(pair.cache.k_store(i), pair.cache.v_store(i)) for i in range(3)]
    snapshot = [(k.clone(), v.clone()) for k, v in before]
    generation, nbytes = pair.cache.generation, pair.cache.nbytes
    calls["n"], calls["fail_at"] = 0, 4  # layer 1's V
    pair.cache.declare_step([a] * 4)
    with pytest.raises(CapacityError, match="unchanged"):
        pair.cache.prepare_step(4)
    assert pair.cache.generation == generation and pair.cache.nbytes == nbytes and pair.cache.pos(a) == 6
    for i, (k, v) in enumerate(before):
        assert pair.cache.k_store(i) is k and pair.cache.v_store(i) is v
        torch.testing.assert_close(k, snapshot[i][0], rtol=0, atol=0, equal_nan=True)  # storage is never
        torch.testing.assert_close(v, snapshot[i][1], rtol=0, atol=0, equal_nan=True)  # zero-filled
    calls["fail_at"] = None
    pair.naive.rewind(a, 6)
    pair.step([a] * 4)  # the declaration still stands; a retry grows and succeeds
    assert pair.cache.reach(a) == 64 and pair.cache.generation == generation + 1


def test_a_one_token_wide_store_has_no_scratch_column_and_still_decodes():
    pair = make_pair(max_seqs=2, max_write=1, max_width=1)
    assert pair.cache.config.scratch_rows == 0 and "scratch" not in pair.cache._store.groups[0].pool.extents
    a, b = pair.new(), pair.new()
    for _ in range(9):  # wraps the ring (4 rows)
        pair.step([a])
        pair.step([b])
    with pytest.raises(StepError):
        pair.cache.declare_step([a])
        pair.cache.prepare_step(2)


def test_a_first_allocation_that_fails_is_a_capacity_error():
    def no_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("injected")

    cfg = CacheConfig(num_layers=1, kv_heads=1, head_dim=8, max_seqs=1, capacity=8, dtype=torch.float32)
    with pytest.raises(CapacityError, match="first 8 rows"):
        BatchedSequenceCache(cfg, "cpu", alloc=no_memory)


def test_the_triton_backend_refuses_a_head_dim_its_kernels_do_not_take_at_construction():
    from batchkv.errors import ConfigError

    cfg = CacheConfig(num_layers=1, kv_heads=1, head_dim=24, max_seqs=1, capacity=8, dtype=torch.float32)
    with pytest.raises(ConfigError, match="head_dim 24"):
        BatchedSequenceCache(cfg, "cpu", attention="triton")
    assert BatchedSequenceCache(cfg, "cpu", attention="reference").config.head_dim == 24
