"""Every refusal raises a typed BatchKVError and changes nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from batchkv import BatchKVError
from batchkv.errors import (
    CapacityError,
    ConfigError,
    ContractError,
    NoFreeColumnError,
    PositionError,
    RingFloorError,
    StepError,
    UnknownSequenceError,
)
from tests.test_cache import make_pair


def snapshot(cache) -> dict:
    return {
        "lengths": {s: cache.pos(s) for s in cache.sequences},
        "floors": {s: cache.ring_floor(s) for s in cache.sequences},
        "plan": cache._declaration,
        "width": cache._width,
        "seq_info": cache.seq_info.clone(),
        "positions": cache.positions.clone(),
        "generation": cache.generation,
        "store": [{name: t.clone() for name, t in cache.planes(i).items()} for i in range(cache.config.num_layers)],
    }


def assert_same(a: dict, b: dict) -> None:
    for key in ("lengths", "floors", "plan", "width", "generation"):
        assert a[key] == b[key], key
    assert torch.equal(a["seq_info"], b["seq_info"]) and torch.equal(a["positions"], b["positions"])
    for planes1, planes2 in zip(a["store"], b["store"], strict=True):
        assert planes1.keys() == planes2.keys()
        for name, t1 in planes1.items():
            # bit for bit, NaN too (contiguous first: e4m3 scale planes are views of rows-last storage)
            assert torch.equal(t1.contiguous().view(torch.uint8), planes2[name].contiguous().view(torch.uint8)), name


@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn])
def test_every_refusal_leaves_everything_unchanged(kv_dtype):
    pair = make_pair(max_seqs=3, capacity=32, max_write=3, max_width=8, kv_dtype=kv_dtype)
    cache = pair.cache
    a, b = pair.new(), pair.new()
    for _ in range(7):
        pair.step([a, a, a, b])  # a: 21 written (ring of 6 rows wrapped, floor 18); b: 7
    full = pair.new()
    cache.declare_step([a, b, b])
    cache.prepare_step(4)  # a standing, prepared step survives every refusal below
    x = torch.zeros(4, 2, 8)
    refusals = [
        (StepError, lambda: cache.declare_step([])),
        (UnknownSequenceError, lambda: cache.declare_step([a, 9])),
        (CapacityError, lambda: cache.declare_step([b] * 4)),  # more than max_write
        (CapacityError, lambda: cache.declare_step([a] * 3 + [b] * 3 + [full] * 3)),  # more than max_width
        (CapacityError, lambda: cache.declare_step([a, b, a, b, a, b, full])),  # 7 runs > 6 segments
        (StepError, lambda: cache.prepare_step(2)),
        (StepError, lambda: cache.prepare_step(9)),
        (NoFreeColumnError, cache.seq_new),
        (NoFreeColumnError, lambda: cache.seq_clone(b)),
        (UnknownSequenceError, lambda: cache.seq_clone(7)),
        (PositionError, lambda: cache.seq_clone(b, upto=8)),
        (RingFloorError, lambda: cache.seq_clone(a, upto=17)),
        (PositionError, lambda: cache.rewind(b, 8)),
        (PositionError, lambda: cache.rewind(b, -1)),
        (RingFloorError, lambda: cache.rewind(a, 17)),
        (UnknownSequenceError, lambda: cache.rewind(5, 0)),
        (UnknownSequenceError, lambda: cache.seq_rm(5)),
        (UnknownSequenceError, lambda: cache.pos(5)),
        (ContractError, lambda: cache.update_and_attend(0, torch.zeros(3, 4, 8), x[:3], x[:3])),
        (ContractError, lambda: cache.update_and_attend(0, torch.zeros(4, 4, 8), x, torch.zeros(4, 2, 4))),
        (ContractError, lambda: cache.update_and_attend(2, torch.zeros(4, 4, 8), x, x)),
    ]
    for expected, call in refusals:
        before = snapshot(cache)
        with pytest.raises(expected) as info:
            call()
        assert isinstance(info.value, BatchKVError) and str(info.value)
        assert_same(before, snapshot(cache))
    pair.rm(full)
    # Capacity: fill b to the limit, then one more token is refused and the declaration stands.
    while cache.pos(b) + 3 <= cache.capacity:
        pair.step([b, b, b])
    cache.declare_step([a])
    plan = cache._declaration
    with pytest.raises(CapacityError, match="capacity is 32"):
        cache.declare_step([b] * 3)
    assert cache._declaration is plan
    assert not cache.can_admit(b, 3) and cache.can_admit(b, 32 - cache.pos(b))


def test_a_failed_forward_commits_nothing():
    pair = make_pair()
    a = pair.new()
    pair.step([a, a, a])
    pair.cache.declare_step([a, a])
    pair.cache.prepare_step(2)
    pair.cache.update_and_attend(0, torch.randn(2, 4, 8), torch.randn(2, 2, 8), torch.randn(2, 2, 8))
    # the forward raises before layer 1; the caller does not commit and simply declares again
    assert pair.cache.pos(a) == 3
    pair.step([a, a])


def test_configs_that_break_a_rule_are_refused():
    from batchkv import CacheConfig, LayerSpec

    with pytest.raises(ConfigError, match="needs window"):
        LayerSpec("ring")
    with pytest.raises(ConfigError, match="policy"):
        LayerSpec("paged")
    with pytest.raises(ConfigError, match="max_write"):
        CacheConfig(num_layers=1, kv_heads=1, head_dim=8, max_seqs=1, capacity=4, max_write=5)
    with pytest.raises(ConfigError, match="layers has 1"):
        CacheConfig(num_layers=2, kv_heads=1, head_dim=8, max_seqs=1, capacity=4, layers=(LayerSpec(),))
    with pytest.raises(ConfigError, match="max_segments"):
        CacheConfig(num_layers=1, kv_heads=1, head_dim=8, max_seqs=4, capacity=4, max_segments=2)


def test_non_integer_ids_and_lengths_are_refused():
    pair = make_pair()
    a = pair.new()
    pair.step([a, a, a])
    before = snapshot(pair.cache)
    for call in (
        lambda: pair.cache.rewind(a, 2.5),
        lambda: pair.cache.rewind(a, True),
        lambda: pair.cache.seq_clone(a, upto=1.0),
        lambda: pair.cache.declare_step([0.9]),
        lambda: pair.cache.declare_step([[a]]),
        lambda: pair.cache.pos(0.0),
    ):
        with pytest.raises((PositionError, UnknownSequenceError)):
            call()
        assert_same(before, snapshot(pair.cache))
    pair.rewind(a, np.int64(2))  # numpy integers are integers
    assert pair.cache.pos(a) == 2
