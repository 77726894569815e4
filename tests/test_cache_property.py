"""Random interleavings of every verb and step against the naive SDPA oracle.

Each drawn operation either succeeds and the cache keeps matching the oracle, or it raises a
BatchKVError and changes nothing; the oracle is only told about operations that succeeded.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from batchkv import BatchedSequenceCache, BatchKVError, CacheConfig, LayerSpec
from tests.oracle import Pair
from tests.test_refusals import assert_same, snapshot

LAYOUTS = [
    (LayerSpec("flat"), LayerSpec("ring", window=2)),
    (LayerSpec("ring", window=3), LayerSpec("flat", window=2)),
    (LayerSpec("flat"),),
]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_verbs_and_steps_match_the_oracle(data):
    run_random_verbs(data, pool_rows=0)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_verbs_and_steps_in_a_store_too_small_for_every_sequence_match_the_oracle(data):
    # 40 rows for three sequences of up to 24 positions: extents move, the pool compacts, and a
    # sequence that finds no room is refused (and that refusal changes nothing)
    run_random_verbs(data, pool_rows=40)


def run_random_verbs(data, pool_rows: int) -> None:
    layers = data.draw(st.sampled_from(LAYOUTS), label="layers")
    max_write = data.draw(st.integers(1, 3), label="max_write")
    cfg = CacheConfig(
        num_layers=len(layers),
        kv_heads=1,
        head_dim=4,
        max_seqs=3,
        capacity=24,
        max_write=max_write,
        layers=layers,
        dtype=torch.float32,
        buckets=(4, 8, 16),
        tail_step=8,
        pool_rows=pool_rows,
    )
    pair = Pair(BatchedSequenceCache(cfg, "cpu", attention="reference"), hq=2, seed=data.draw(st.integers(0, 99)))
    cache = pair.cache
    any_id = st.integers(0, 3)  # includes an id that is never held
    back_off = st.integers(-1, 6)  # rewinds and clones land around the ring floor, and past both ends

    def target(seq: int) -> int:
        """A length near the end of `seq`, near its ring floor, or just outside either."""
        if seq not in cache.sequences:
            return 0
        if data.draw(st.booleans()):
            return cache.ring_floor(seq) + data.draw(st.integers(-1, 2))
        return cache.pos(seq) - data.draw(back_off)

    pair.new(), pair.new()
    for _ in range(data.draw(st.integers(5, 40), label="ops")):
        op = data.draw(st.sampled_from(["new", "clone", "rm", "rewind", "rewind", *["step"] * 8]))
        before = snapshot(cache)
        try:
            if op == "new":
                pair.new()
            elif op == "clone":
                src = data.draw(any_id)
                pair.clone(src, data.draw(st.none() | st.just(target(src))))
            elif op == "rm":
                pair.rm(data.draw(any_id))
            elif op == "rewind":
                seq = data.draw(any_id)
                pair.rewind(seq, target(seq))
            else:
                ids = []
                held = st.sampled_from(cache.sequences) if cache.sequences else any_id
                for seq in data.draw(st.lists(held, min_size=1, max_size=3)):
                    ids += [seq] * data.draw(st.integers(1, max_write + (seq == 0)))  # seq 0 may exceed
                if data.draw(st.booleans()):
                    data.draw(st.randoms()).shuffle(ids)  # otherwise each sequence's tokens form runs
                pad = data.draw(st.integers(0, 2))
                pair.step(ids, width=min(len(ids) + pad, cfg.max_width))
            event(f"{op} ok")
            if any(cache.ring_floor(s) for s in cache.sequences):
                event("a ring wrapped")
        except BatchKVError as exc:
            event(f"{op} refused: {type(exc).__name__}")
            assert_same(before, snapshot(cache))
        assert set(cache.sequences) == set(pair.naive.k)
        for seq in cache.sequences:
            assert cache.pos(seq) == pair.naive.length(seq)
