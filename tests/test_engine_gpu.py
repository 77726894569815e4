"""CUDA graphs in the engine (run on the H200): graphs decode exactly what eager decodes, one graph
per width bucket and storage generation, and nothing grows with the number of requests served."""

from __future__ import annotations

import gc
import random

import pytest
import torch

from batchkv.cli.workload import WorkItem, replay, synthetic
from batchkv.executor import Engine, Request, SamplingParams
from tests.executor_helpers import drive, random_prompt
from tests.toy_model import ToyModel

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model():
    # head_dim 64, GQA 4: a shape the Triton kernel serves; bf16 like the real model.
    return ToyModel(vocab=512, hidden=256, heads=8, kv_heads=2, head_dim=64, window=32,
                    dtype=torch.bfloat16, device="cuda", seed=0)  # fmt: skip


def engine(model, use_graphs, **kwargs) -> Engine:
    opts = {"max_seqs": 8, "capacity": 320, "max_step_tokens": 64, "prefill_chunk": 32, "device": "cuda"}
    return Engine(model, use_graphs=use_graphs, **(opts | kwargs))


def mixed_schedule(seed: int) -> tuple[list[tuple[int, Request]], dict[int, list[int]]]:
    rng = random.Random(seed)
    schedule = []
    for i in range(24):
        params = SamplingParams(
            max_new_tokens=rng.randint(1, 60),
            temperature=rng.choice([0.0, 0.0, 0.0, 0.8]),
            top_k=rng.choice([0, 20]),
            seed=i,
            n=rng.choice([1, 1, 1, 2, 3]),
            stop_token_ids=(rng.randrange(512),),
        )
        arrival = rng.randint(0, 8) if i in (1, 5, 9) else rng.randint(0, 40)  # arrive before their cancels
        schedule.append((arrival, Request(random_prompt(rng, 1, 100, vocab=512), params)))
    # Arrives after graphs exist and crosses the 64- and 128-row boundaries: storage grows mid-run.
    schedule.append((30, Request(random_prompt(rng, 150, 150, vocab=512), SamplingParams(max_new_tokens=100))))
    cancels = {12: [1, 5], 25: [9]}
    return schedule, cancels


@pytest.mark.parametrize("seed", [0, 1])
def test_graphs_decode_the_same_tokens_as_eager(model, seed):
    schedule, cancels = mixed_schedule(seed)
    kwargs = {"row_buckets": (64, 128), "row_step": 64}
    eager = engine(model, False, **kwargs)
    graphed = engine(model, True, **kwargs)
    expected, eager_ids = drive(eager, schedule, cancels)
    got, graph_ids = drive(graphed, schedule, cancels)
    assert graphed.uses_graphs and not eager.uses_graphs
    for index in range(len(schedule)):
        assert got[graph_ids[index]] == expected[eager_ids[index]], f"request {index}"
    m = graphed.metrics
    assert m.growths >= 2 and m.captures > 0 and m.replays == m.steps
    assert m.captures <= 2 * m.summary()["width_buckets_used"] * (1 + m.growths)  # 2: short steps key apart
    graphed.assert_idle()


def test_200_requests_capture_per_bucket_and_growth_and_hold_memory_flat(model):
    served = engine(model, True, max_seqs=16, capacity=512, kv_positions=16 * 512)  # allocated whole
    items = synthetic(200, vocab_size=512, prompt_len=(1, 200), output_len=(1, 100), arrival_gap=0.5, seed=3)
    longest = Request(random_prompt(random.Random(3), 300, 300, vocab=512), SamplingParams(max_new_tokens=200))
    items[0] = WorkItem(0, longest)  # the longest history arrives first: storage grows once, up front
    replay(served, items[:20])
    torch.cuda.synchronize()
    after_20 = torch.cuda.memory_allocated()
    reserved_20 = torch.cuda.memory_reserved()
    replay(served, items[20:])
    torch.cuda.synchronize()
    after_200 = torch.cuda.memory_allocated()
    m = served.metrics.summary()
    assert m["requests_submitted"] == 200 and sum(m["finished"].values()) == 200
    assert m["growths"] == 0 and m["captures"] <= 2 * m["width_buckets_used"], m  # with and without long runs
    memory = (after_20, after_200, reserved_20, torch.cuda.memory_reserved())
    assert abs(after_200 - after_20) <= 0.01 * after_20, memory
    served.assert_idle()


@pytest.mark.parametrize("how", ["close", "del"])
def test_close_and_del_give_the_device_memory_back_without_a_gc_pass(model, how):
    items = synthetic(12, vocab_size=512, prompt_len=(1, 60), output_len=(1, 20), arrival_gap=0.5, seed=4)
    warm = engine(model, True, max_seqs=8, capacity=256)
    replay(warm, items)  # process-wide state (the kernels' merge counters, cuBLAS) is made once, here
    warm.close()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    gc.disable()  # a reference cycle would hold the engine until the collector ran
    try:
        served = engine(model, True, max_seqs=8, capacity=256)
        replay(served, items)
        torch.cuda.synchronize()
        assert served.metrics.captures > 0 and torch.cuda.memory_allocated() > base
        if how == "close":
            served.close()
        else:
            del served
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() == base
    finally:
        gc.enable()


def test_an_engine_sized_after_another_was_closed_gets_its_memory(model):
    # The closed engine's blocks stay in torch's cache; sizing gives them back before it measures,
    # so the second engine's store is as large as the first's, not what the cache left over.
    first = engine(model, True, max_seqs="auto", memory_fraction=0.5, capacity=256)
    positions = first.sizing.positions
    first.close()
    second = engine(model, True, max_seqs="auto", memory_fraction=0.5, capacity=256)
    assert second.sizing.positions >= 0.95 * positions, (second.sizing.describe(), positions)
    second.close()


@pytest.mark.parametrize("overlap", [False, True])
def test_the_prefix_cache_under_graphs_decodes_what_it_decodes_eagerly(model, overlap):
    # Adopted and cloned columns (copies on the device, between captured steps) read back the same
    # K/V with and without graphs; the cache must really reuse, or the test proves nothing.
    rng = random.Random(5)
    system = random_prompt(rng, 96, 96, vocab=512)
    schedule = [(i // 4, Request(system + random_prompt(rng, 1, 20, vocab=512),
                                 SamplingParams(max_new_tokens=rng.randint(4, 30), n=rng.choice([1, 1, 2]))))
                for i in range(16)]  # fmt: skip
    runs = []
    for use_graphs in (False, True):
        e = engine(model, use_graphs, overlap=overlap, prefix_cache=True)
        got, ids = drive(e, schedule)
        runs.append([got[i] for i in ids])
        assert e.metrics.summary()["prefix_reused_tokens"] >= 12 * 96, e.metrics.summary()
        e.assert_idle()
    assert runs[0] == runs[1]


def test_after_warm_up_serving_captures_no_graph_and_decodes_what_eager_decodes(model):
    schedule, cancels = mixed_schedule(2)
    whole = {"kv_positions": 8 * 320}  # allocated whole: storage never moves, so the captures last
    eager = engine(model, False, **whole)
    expected, eager_ids = drive(eager, schedule, cancels)
    graphed = engine(model, True, **whole)
    assert graphed.warm_up() > 0
    runner = graphed.runner
    decode = min(w for w in graphed.buckets if w >= runner.rows)  # the widest decode step's width
    # widths whose chunks are long and a decode step can take: also captured short
    long = sum(min(graphed.cache.config.max_write, w) > 16 and w <= decode for w in graphed.buckets)
    assert runner.captures == len(graphed.buckets) + long and graphed.metrics.steps == 0
    captured, replayed = runner.captures, runner.replays
    got, graph_ids = drive(graphed, schedule, cancels)
    for index in range(len(schedule)):
        assert got[graph_ids[index]] == expected[eager_ids[index]], f"request {index}"
    assert runner.captures == captured and runner.replays - replayed == graphed.metrics.steps > 0
