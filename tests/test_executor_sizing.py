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


# ---- Engine(max_seqs="auto") ------------------------------------------------------------------
def _toy():
    from tests.toy_model import ToyModel

    return ToyModel(seed=0)


def _template(model, capacity: int) -> CacheConfig:
    return CacheConfig(**model.cache_spec(), max_seqs=1, capacity=capacity, max_write=8, max_width=16)


def test_auto_max_seqs_takes_the_columns_that_fit_and_allocates_them_up_front(monkeypatch):
    from batchkv.executor import Engine, Request, SamplingParams, gather
    from batchkv.executor import sizing as sizing_module
    from tests.executor_helpers import oracle

    model = _toy()
    per = column_bytes(_template(model, 48))
    monkeypatch.setattr(sizing_module, "device_memory", lambda device: (100 * per, 90 * per))
    engine = Engine(model, max_seqs="auto", memory_fraction=0.95, capacity=48, max_step_tokens=16, prefill_chunk=8)
    # budget 95 columns' worth, 90 in use: 5 left, one of them the scratch column
    assert engine.sizing.max_seqs == engine.cache.max_seqs == 4 == engine.metrics.max_seqs
    assert engine.cache.rows == 48 and engine.cache.nbytes == engine.sizing.store_bytes  # allocated whole
    assert "4 sequences x 48 positions" in engine.sizing.describe()
    request = Request([3, 1, 4, 1, 5], SamplingParams(max_new_tokens=6))
    rid = engine.submit(request)
    out = gather(engine.run_until_done())[rid]
    assert (out.tokens[0], out.finish_reasons[0]) == oracle(model, request, 48)
    assert engine.metrics.growths == 0


def test_auto_max_seqs_stops_at_64_columns_and_refuses_when_none_fits(monkeypatch):
    from batchkv.executor import MAX_SAMPLE_ROWS, Engine
    from batchkv.executor import sizing as sizing_module

    model = _toy()
    per = column_bytes(_template(model, 32))
    monkeypatch.setattr(sizing_module, "device_memory", lambda device: (1000 * per, 0))
    engine = Engine(model, max_seqs="auto", capacity=32, max_step_tokens=16, prefill_chunk=8)
    assert engine.cache.max_seqs == MAX_SAMPLE_ROWS  # a step samples at most 64 rows
    monkeypatch.setattr(sizing_module, "device_memory", lambda device: (10 * per, 9 * per))
    with pytest.raises(CapacityError, match="lower capacity"):
        Engine(model, max_seqs="auto", capacity=32, max_step_tokens=16, prefill_chunk=8)
    with pytest.raises(ConfigError, match="memory_fraction"):
        Engine(model, max_seqs="auto", capacity=32, max_step_tokens=16, prefill_chunk=8, memory_fraction=1.5)


def test_capacity_none_is_the_models_max_positions_else_the_default():
    from batchkv.executor import Engine
    from batchkv.executor.sizing import DEFAULT_CAPACITY

    model = _toy()
    assert Engine(model, max_step_tokens=16, prefill_chunk=8).cache.capacity == DEFAULT_CAPACITY
    model.max_positions = 640
    assert Engine(model, max_step_tokens=16, prefill_chunk=8).cache.capacity == 640
    assert Engine(model, capacity=100, max_step_tokens=16, prefill_chunk=8).cache.capacity == 100
