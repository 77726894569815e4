"""Sizing the store to a memory budget: columns that fit at full capacity, refusals that say what to lower."""

from __future__ import annotations

import pytest
import torch

from batchkv.cache import BatchedSequenceCache, CacheConfig, LayerSpec
from batchkv.errors import CapacityError, ConfigError
from batchkv.executor.sizing import ACTIVATION_COPIES, column_bytes, device_memory, plan

GIB = 2**30


def config(**kw) -> CacheConfig:
    base = dict(num_layers=4, kv_heads=2, head_dim=16, max_seqs=1, capacity=1024, max_write=8, dtype=torch.float16)
    return CacheConfig(**{**base, **kw})


def test_a_column_at_capacity_is_what_the_store_allocates_per_column():
    cfg = config(layers=(LayerSpec(), LayerSpec("ring", window=32), LayerSpec(), LayerSpec("flat", window=16)))
    one, three = (BatchedSequenceCache(config(layers=cfg.layers, max_seqs=n), "cpu") for n in (1, 3))
    for cache in (one, three):
        cache.reserve(cfg.capacity)
    assert three.nbytes - one.nbytes == 2 * column_bytes(cfg)
    # 3 flat layers of 1024 rows and a ring of 32 + 8 - 1 rows, K and V, fp16
    assert column_bytes(cfg) == (3 * 1024 + 39) * 2 * 2 * 16 * 2


def test_plan_gives_every_column_that_fits_after_weights_and_activations():
    cfg = config()
    per = column_bytes(cfg)
    total, in_use, act = 100 * per, 30 * per, 5 * per
    sizing = plan(cfg, total=total, in_use=in_use, activations=act, memory_fraction=0.9)
    room = int(0.9 * total) - in_use - ACTIVATION_COPIES * act
    assert sizing.max_seqs == (room - per) // per  # one column's worth goes to the scratch column
    assert sizing.store_bytes == (sizing.max_seqs + 1) * per <= room
    assert sizing.store_bytes + per > room  # one more column would not fit


def test_a_decode_only_store_has_no_scratch_column_to_pay_for():
    cfg = config(max_write=1, max_width=1)
    per = column_bytes(cfg)
    assert plan(cfg, total=10 * per, in_use=0, activations=0, memory_fraction=1.0).max_seqs == 10


def test_plan_refuses_when_not_one_sequence_fits_and_says_what_to_lower():
    cfg = config()
    with pytest.raises(CapacityError, match="lower capacity, raise memory_fraction"):
        plan(cfg, total=GIB, in_use=GIB - 1, activations=0, memory_fraction=0.9)
    with pytest.raises(CapacityError, match="8 sequence"):
        plan(cfg, total=8 * column_bytes(cfg), in_use=0, activations=0, memory_fraction=1.0, max_seqs=8)


@pytest.mark.parametrize("fraction", [0.0, 1.5, -0.1])
def test_plan_refuses_a_fraction_outside_0_1(fraction):
    with pytest.raises(ConfigError, match="memory_fraction"):
        plan(config(), total=GIB, in_use=0, activations=0, memory_fraction=fraction)


def test_the_cpu_reports_its_physical_memory():
    total, in_use = device_memory(torch.device("cpu"))
    assert 0 <= in_use <= total and total > 2**28
