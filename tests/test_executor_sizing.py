"""Sizing the store to a memory budget: the positions that fit, refusals that say what to lower."""

from __future__ import annotations

import pytest
import torch

from batchkv.cache import BatchedSequenceCache, CacheConfig, LayerSpec
from batchkv.errors import CapacityError, ConfigError, RequestError
from batchkv.executor.sizing import ACTIVATION_COPIES, device_memory, plan, store_bytes

GIB = 2**30


def config(**kw) -> CacheConfig:
    base = dict(num_layers=4, kv_heads=2, head_dim=16, max_seqs=1, capacity=1024, max_write=8, dtype=torch.float16)
    return CacheConfig(**{**base, **kw})


def test_store_bytes_are_what_a_whole_store_allocates_with_rings_capped_at_their_ring():
    layers = (LayerSpec(), LayerSpec("ring", window=32), LayerSpec(), LayerSpec("flat", window=16))
    for pool_rows in (100, 3 * 1024 + 16):
        cfg = config(layers=layers, max_seqs=3, pool_rows=pool_rows)
        assert BatchedSequenceCache(cfg, "cpu").nbytes == store_bytes(cfg, pool_rows)
    # 3 flat layers of the pool's rows, and a ring pool of at most 3 rings of 32 + 8 - 1 rows and the
    # 8 scratch rows (max_width = 3 * 8 ... capped at 16 scratch rows: min(16, 24)); K and V, fp16
    cfg = config(layers=layers, max_seqs=3)
    assert store_bytes(cfg, 1000) == (3 * 1000 + min(1000, 3 * 39 + 16)) * 2 * 2 * 16 * 2


def test_plan_gives_every_position_that_fits_after_weights_and_activations():
    cfg = config(max_seqs=64)
    per = cfg.bytes_per_position()
    total, in_use, act = 10_000 * per, 3_000 * per, 500 * per
    sizing = plan(cfg, total=total, in_use=in_use, activations=act, memory_fraction=0.9)
    room = int(0.9 * total) - in_use - ACTIVATION_COPIES * act
    scratch = cfg.scratch_rows
    assert sizing.positions == room // per - scratch  # the scratch rows are paid for too
    assert sizing.store_bytes == store_bytes(cfg, sizing.positions + scratch) <= room
    assert store_bytes(cfg, sizing.positions + scratch + 1) > room  # one more position would not fit


def test_plan_takes_no_more_than_every_sequence_at_full_capacity():
    cfg = config(max_seqs=2, capacity=100)
    per = cfg.bytes_per_position()
    assert plan(cfg, total=10_000 * per, in_use=0, activations=0, memory_fraction=1.0).positions == 200


def test_a_decode_only_store_has_no_scratch_rows_to_pay_for():
    cfg = config(max_write=1, max_width=1, max_seqs=10)
    per = cfg.bytes_per_position()
    assert plan(cfg, total=10 * 1024 * per, in_use=0, activations=0, memory_fraction=1.0).positions == 10 * 1024


def test_plan_refuses_when_not_one_sequence_fits_and_says_what_to_lower():
    cfg = config()
    with pytest.raises(CapacityError, match="lower capacity, raise memory_fraction"):
        plan(cfg, total=GIB, in_use=GIB - 1, activations=0, memory_fraction=0.9)
    with pytest.raises(CapacityError, match="8000 positions"):
        plan(cfg, total=8 * cfg.capacity * cfg.bytes_per_position(), in_use=0, activations=0, memory_fraction=1.0,
             positions=8000)  # fmt: skip


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


def test_auto_max_seqs_takes_the_positions_that_fit_and_allocates_them_up_front(monkeypatch):
    from batchkv.executor import MAX_SAMPLE_ROWS, Engine, Request, SamplingParams, gather
    from batchkv.executor import sizing as sizing_module
    from tests.executor_helpers import oracle

    model = _toy()
    per = CacheConfig(**model.cache_spec(), max_seqs=1, capacity=48).bytes_per_position()
    monkeypatch.setattr(sizing_module, "device_memory", lambda device: (10_000 * per, 9_000 * per))
    engine = Engine(model, max_seqs="auto", memory_fraction=0.95, capacity=48, max_step_tokens=16, prefill_chunk=8)
    # budget 9,500 positions' worth, 9,000 in use: 500 left, 16 of them the scratch rows; the 484
    # positions hold 10 requests at the full capacity of 48 (below the AUTO_REACH of 512)
    assert engine.cache.max_seqs == 10 == engine.metrics.max_seqs == engine.scheduler.sample_rows
    assert engine.cache.max_seqs < MAX_SAMPLE_ROWS
    # and 10 sequences of 48 never use more than 480 positions: the pool stops there
    assert engine.sizing.positions == 10 * 48 and engine.cache.pool_rows == 480 + 16
    assert engine.cache.nbytes == engine.sizing.store_bytes  # allocated whole
    assert "a pool of 480 positions for at most 10 sequences" in engine.sizing.describe()
    request = Request([3, 1, 4, 1, 5], SamplingParams(max_new_tokens=6))
    rid = engine.submit(request)
    out = gather(engine.run_until_done())[rid]
    assert (out.tokens[0], out.finish_reasons[0]) == oracle(model, request, 48)
    assert engine.metrics.growths == 0


def test_a_whole_store_holds_short_requests_by_their_reach_and_makes_a_long_one_wait_its_turn():
    from batchkv.executor import Engine, Request, SamplingParams, gather
    from tests.executor_helpers import oracle

    model = _toy()
    engine = Engine(model, max_seqs=16, kv_positions=64, capacity=48, max_step_tokens=16, prefill_chunk=8)
    short = [Request([1 + i, 2, 3], SamplingParams(max_new_tokens=6)) for i in range(8)]  # reach 8 each: 64 rows
    long = Request(list(range(1, 30)), SamplingParams(max_new_tokens=10))  # reach 38
    ids = [engine.submit(r) for r in short] + [engine.submit(long)]
    events = engine.step()
    assert len(engine.cache.sequences) == 8 and engine.num_waiting == 1  # eight short ones at once, by reach
    outputs = gather(events + engine.run_until_done())
    for rid, request in zip(ids, [*short, long], strict=True):
        assert (outputs[rid].tokens[0], outputs[rid].finish_reasons[0]) == oracle(model, request, 48)
    with pytest.raises(RequestError, match="more than the store's 64 together"):  # 2 samples of reach 47
        engine.submit(Request(list(range(1, 40)), SamplingParams(max_new_tokens=9, n=2)))
    engine.assert_idle()


def test_rows_a_long_request_held_serve_the_next_one_when_it_ends_without_the_store_growing():
    from batchkv.executor import Engine, Request, SamplingParams, gather
    from tests.executor_helpers import oracle

    model = _toy()
    engine = Engine(model, max_seqs=8, kv_positions=48, capacity=48, max_step_tokens=16, prefill_chunk=8)
    nbytes, generation = engine.cache.nbytes, engine.cache.generation
    first = Request(list(range(1, 31)), SamplingParams(max_new_tokens=9))  # reach 38 of the 48 positions
    second = Request(list(range(2, 32)), SamplingParams(max_new_tokens=9))  # 38 more: waits for the first's
    short = Request([5, 6, 7], SamplingParams(max_new_tokens=4))  # reach 6: fits beside the first
    ids = [engine.submit(r) for r in (first, second, short)]
    events, seen = [], []
    for _ in range(200):
        if not engine.has_work:
            break
        events += engine.step()
        seen.append((len(engine.cache.sequences), engine.num_waiting))
    assert not engine.has_work
    # the second waited (and the short one behind it: admission is FIFO) while the first held its rows,
    # then took them when the first ended, and the short one came in beside it
    assert seen[0] == (1, 2) and (2, 0) in seen
    assert engine.cache.nbytes == nbytes and engine.cache.generation == generation  # reused, never grown
    outputs = gather(events)
    for rid, request in zip(ids, (first, second, short), strict=True):
        assert (outputs[rid].tokens[0], outputs[rid].finish_reasons[0]) == oracle(model, request, 48)
    engine.assert_idle()


def test_a_short_request_beside_a_long_one_costs_its_own_reach_not_the_long_ones():
    from batchkv.executor import Engine, Request, SamplingParams

    engine = Engine(_toy(), max_seqs=8, capacity=256, max_step_tokens=16, prefill_chunk=8)
    engine.submit(Request([1 + i % 90 for i in range(199)], SamplingParams(max_new_tokens=40)))  # reach 238
    for _ in range(4):
        engine.submit(Request([1, 2, 3], SamplingParams(max_new_tokens=5)))  # reach 7 each
    engine.step()
    reaches = sorted(engine.cache.reach(seq) for seq in engine.cache.sequences)
    assert reaches == [7, 7, 7, 7, 238]
    held = engine.cache.config.max_pool_rows() - engine.cache.free_rows  # (free_rows counts the room to grow)
    assert held == 4 * 7 + 238 + engine.cache.config.scratch_rows  # rows held: the reaches and the scratch rows
    engine.run_until_done()
    engine.assert_idle()


def test_auto_max_seqs_refuses_when_not_one_sequence_fits(monkeypatch):
    from batchkv.executor import Engine
    from batchkv.executor import sizing as sizing_module

    model = _toy()
    per = CacheConfig(**model.cache_spec(), max_seqs=1, capacity=32).bytes_per_position()
    monkeypatch.setattr(sizing_module, "device_memory", lambda device: (1000 * per, 990 * per))
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


class _Wrapped:
    """A model as HFModel holds one: the transformers module under `hf`, on `device`."""

    def __init__(self, weight_bytes: int, device: str, dtype: torch.dtype = torch.bfloat16) -> None:
        elements = weight_bytes // torch.empty((), dtype=dtype).element_size()
        self.hf = torch.nn.Linear(elements // 1024, 1024, bias=False, device="meta", dtype=dtype)
        self.device = torch.device(device)


def test_auto_step_tokens_keeps_1024_for_16_gb_of_weights_and_doubles_as_the_weights_shrink():
    from batchkv.executor.sizing import DEFAULT_STEP_TOKENS, MOST_AUTO_STEP_TOKENS, auto_step_tokens

    # a step of 2n tokens through w bytes at most as costly as 1,024 through 16 GB: 2n * w <= 1024 * 16e9
    assert auto_step_tokens(_Wrapped(16_060_000_000, "cuda")) == DEFAULT_STEP_TOKENS == 1024  # Llama-3.1-8B, bf16
    assert auto_step_tokens(_Wrapped(8 * 10**9, "cuda")) == 2048
    assert auto_step_tokens(_Wrapped(3 * 10**9, "cuda")) == 4096  # 2 * 4096 * 3e9 > 1024 * 16e9: not 8,192
    assert auto_step_tokens(_Wrapped(270_000_000, "cuda")) == MOST_AUTO_STEP_TOKENS == 8192  # SmolLM2-135M: capped
    fp8 = _Wrapped(8 * 10**9, "cuda", torch.float8_e4m3fn)  # bytes, not elements: fp8 weights count half
    assert auto_step_tokens(fp8) == 2048
    assert auto_step_tokens(_Wrapped(270_000_000, "cpu")) == DEFAULT_STEP_TOKENS  # off CUDA: the default
    assert auto_step_tokens(object()) == DEFAULT_STEP_TOKENS  # weights it cannot count: the default


def test_weight_bytes_counts_a_modules_parameters_and_buffers():
    from batchkv.executor.sizing import weight_bytes

    module = torch.nn.Linear(8, 4, device="meta", dtype=torch.bfloat16)  # 32 + 4 elements of 2 bytes
    module.register_buffer("weight_scale", torch.empty(4, dtype=torch.float32, device="meta"))
    assert weight_bytes(module) == 36 * 2 + 4 * 4
    assert weight_bytes(_Wrapped(1 << 20, "cpu")) == 1 << 20


def test_engine_takes_auto_step_tokens_and_refuses_another_word():
    from batchkv.executor import Engine

    assert Engine(_toy(), max_step_tokens="auto", prefill_chunk=8).scheduler.max_step_tokens == 1024  # on the CPU
    with pytest.raises(ConfigError, match="max_step_tokens"):
        Engine(_toy(), max_step_tokens="many", prefill_chunk=8)
