"""Graph keys on the CPU: which (width bucket, generation, fingerprint) a step would replay.

A recording stand-in for `GraphSet` runs the step function eagerly and records each key, so the
keying, the padded logits selector and the retirement of stale generations are checked without a
GPU. The real captures are covered by tests/test_engine_gpu.py.
"""

from __future__ import annotations

import gc
import random
import subprocess
import sys
import weakref

import pytest
import torch

from batchkv.errors import StepError
from batchkv.executor import Engine, Request
from batchkv.executor.graphs import freeze_heap
from tests.executor_helpers import drive, greedy, oracle, random_prompt
from tests.toy_model import ToyModel


class RecordingGraphs:
    """GraphSet's interface. Like a CUDA graph, a replay re-runs the function *captured* for the
    key (not the one passed this time), so a step that reads anything but the static buffers, or
    whose key misses something the function depends on, decodes wrong tokens here."""

    def __init__(self) -> None:
        self.keys: dict = {}
        self.captures = self.replays = 0
        self.retired: list = []

    def __len__(self) -> int:
        return len(self.keys)

    def __contains__(self, key) -> bool:
        return key in self.keys

    def run(self, key, fn):
        if key not in self.keys:
            self.keys[key] = fn
            self.captures += 1
        self.replays += 1
        return self.keys[key]()

    def retain(self, keep) -> None:
        for key in [k for k in self.keys if not keep(k)]:
            self.retired.append(key)
            del self.keys[key]


def graph_engine(model, **kwargs) -> tuple[Engine, RecordingGraphs]:
    engine = Engine(model, max_seqs=4, capacity=96, max_step_tokens=16, prefill_chunk=8, **kwargs)
    graphs = RecordingGraphs()
    engine.runner.graphs, engine.runner.pad_rows = graphs, True
    return engine, graphs


@pytest.mark.parametrize("overlap", [False, True])
def test_one_key_per_width_bucket_and_generation_whatever_the_length_mix(overlap):
    model = ToyModel(seed=1)
    engine, graphs = graph_engine(model, row_buckets=(16, 32), row_step=32, overlap=overlap)
    rng = random.Random(11)
    schedule = [(rng.randint(0, 25), Request(random_prompt(rng, 1, 30), greedy(rng.randint(1, 20)))) for _ in range(10)]
    schedule.append((12, Request(random_prompt(rng, 40, 40), greedy(30))))  # grows the store mid-run
    outputs, ids = drive(engine, schedule)
    for index, (_, request) in enumerate(schedule):  # padded selector rows change nothing
        assert (outputs[ids[index]].tokens[0], outputs[ids[index]].finish_reasons[0]) == oracle(model, request, 96)
    fingerprint = engine.runner.fingerprint()
    all_keys = set(graphs.keys) | set(graphs.retired)
    # 8-token prompt chunks: every run is short, so every step keys (width, True)
    assert all(width in engine.buckets and short and fp == fingerprint for (width, short), _, fp in all_keys)
    assert graphs.captures == len(all_keys)  # each key captured once, however many length mixes replayed it
    assert graphs.replays == engine.metrics.steps > graphs.captures
    assert graphs.retired and engine.metrics.growths >= 1  # graphs of the old storage were dropped
    assert {gen for _, gen, _ in graphs.keys} == {engine.cache.generation}
    assert engine.metrics.captures == graphs.captures and engine.metrics.replays == graphs.replays


def test_a_changed_module_tree_gets_a_new_graph():
    model = ToyModel(seed=2)
    engine, graphs = graph_engine(model)
    engine.submit(Request([1, 2, 3], greedy(3)))
    engine.run_until_done()
    before = set(graphs.keys)
    model.blocks[0]["o"] = torch.nn.Linear(32, 32, bias=False)  # an adapter bound in place of a layer
    engine.submit(Request([1, 2, 3], greedy(3)))
    engine.run_until_done()
    new = set(graphs.keys) - before
    assert new and all(key[2] != next(iter(before))[2] for key in new)
    assert before <= set(graphs.retired)  # graphs of the old tree are dropped, not kept alongside


def watch_hints(engine, graphs: RecordingGraphs, launches: list) -> list:
    """Check that every attention call of a replay gets the hint its key says (a CUDA graph fixes it at capture;
    RecordingGraphs re-runs the function). Returns the replays as they happen: (key head, the cache's short_step,
    entries `launches` gained during it)."""
    replays, hints = [], []
    real_run, real_attend = graphs.run, engine.cache._attend
    engine.cache._attend = lambda *args, **kwargs: (hints.append(kwargs["max_q_len"]), real_attend(*args, **kwargs))[1]

    def run(key, fn):
        seen, before, short_step = len(hints), len(launches), engine.cache.short_step
        out = real_run(key, fn)
        assert set(hints[seen:]) == {16 if key[0][1] else None}, (key, hints[seen:])
        replays.append((key[0], short_step, len(launches) - before))
        return out

    graphs.run = run
    return replays


def serve_as_the_oracle(engine, model, requests) -> None:
    """Submit `requests` at once, run until done: each gets the oracle's tokens."""
    ids = [engine.submit(r) for r in requests]
    events = engine.run_until_done()
    for rid, request in zip(ids, requests, strict=True):
        tokens = [e.token for e in events if e.request_id == rid and e.token is not None]
        assert (tokens, "length") == oracle(model, request, 64)


def test_short_steps_key_apart_and_their_attention_launches_no_prompt_chunk_kernel(monkeypatch):
    """Triton attention (the interpreter): a step with a 32-token prompt chunk keys (width, False) and launches
    the long kernel in each layer; a step whose runs have at most 16 tokens (a short chunk beside decodes, or
    decodes alone) keys (width, True) and launches none. Tokens match the oracle, and every attention call of a
    key gets the hint its key says (a CUDA graph fixes it at capture; RecordingGraphs re-runs the function)."""
    from batchkv.ops.sdpa import launch

    launches = []
    real = launch._launch_long
    monkeypatch.setattr(launch, "_launch_long", lambda *args, **kwargs: (launches.append(1), real(*args, **kwargs)))
    model = ToyModel(seed=6, head_dim=16)
    engine = Engine(model, max_seqs=2, capacity=64, max_step_tokens=48, prefill_chunk=32, attention="triton")
    graphs = RecordingGraphs()
    engine.runner.graphs, engine.runner.pad_rows = graphs, True
    replays = watch_hints(engine, graphs, launches)
    serve_as_the_oracle(engine, model, [Request(list(range(3, 43)), greedy(3)), Request([5, 6, 7], greedy(4))])
    steps = [(head[1], n) for head, _, n in replays]
    layers = len(engine.cache.config.layers)
    assert steps[0] == (False, layers)  # the 40-token prompt's first 32-token chunk
    assert {n for short, n in steps if short} == {0} and sum(short for short, _ in steps) >= 3


def test_warm_captures_a_short_graph_beside_each_long_width_up_to_the_widest_decode_step():
    # 32 logits rows: a decode step is at most 32 tokens wide, so the 64-token width gets no short graph
    model = ToyModel(seed=7)
    engine = Engine(model, max_seqs=32, capacity=8 * 96, max_step_tokens=64, prefill_chunk=32)
    graphs = RecordingGraphs()
    engine.runner.graphs, engine.runner.pad_rows = graphs, True
    engine.runner.warm(engine.buckets)
    share, decode = engine.cache.config.max_write, min(w for w in engine.buckets if w >= engine.runner.rows)
    long = {width for width in engine.buckets if min(share, width) > 16}
    assert decode in long and max(engine.buckets) > decode  # both kinds of long width exist here
    assert {key[0] for key in graphs.keys} == {(w, w not in long) for w in engine.buckets} | {
        (w, True) for w in long if w <= decode
    }
    engine.assert_idle()  # the warm steps' sequences are gone


def test_a_speculating_engine_warms_up_with_a_short_graph_at_every_long_width():
    # Verify blocks are short steps whose every token is a logits row: any width can be one.
    from batchkv.executor import SpeculativeConfig

    engine = Engine(ToyModel(seed=7), max_seqs=4, capacity=96, max_step_tokens=64, prefill_chunk=32,
                    speculative=SpeculativeConfig("ngram", block_size=4))  # fmt: skip
    graphs = RecordingGraphs()
    engine.runner.graphs = graphs
    engine.warm_up()
    long = {w for w in engine.buckets if min(engine.cache.config.max_write, w) > 16}
    assert long and long <= {key[0][0][0] for key in graphs.keys if key[0][1]}
    engine.assert_idle()


def test_a_short_step_wider_than_the_short_graphs_replays_the_long_graph_without_the_hint():
    """After warm-up (4 logits rows: no short graph above width 4), three 12-token prompts make a short step
    32 tokens wide (chunks land on a width: 12 + 12 + 8): it replays the width's long graph, its attention
    calls get no hint, nothing is captured, and the tokens are the oracle's."""
    model = ToyModel(seed=8, head_dim=16)
    engine = Engine(model, max_seqs=4, capacity=512, max_step_tokens=64, prefill_chunk=32, attention="triton")
    graphs = RecordingGraphs()
    engine.runner.graphs, engine.runner.pad_rows = graphs, True
    engine.runner.warm(engine.buckets)
    captured = graphs.captures
    replays = watch_hints(engine, graphs, [])
    serve_as_the_oracle(engine, model, [Request(list(range(3 + 12 * i, 15 + 12 * i)), greedy(3)) for i in range(3)])
    wide = [(head, step_short) for head, step_short, _ in replays if head[0] > 16]  # the three prompts' step
    assert wide and all(step_short and not head[1] for head, step_short in wide)  # short, served by the long graph
    assert graphs.captures == captured and any(head[1] for head, _, _ in replays)  # decode steps: short graphs


def test_adapter_wrappers_turn_graphs_off_and_drop_the_captures(monkeypatch):
    import batchkv.executor.graphs as graph_module

    class Wrapper(torch.nn.Module):
        def __init__(self, base: torch.nn.Module) -> None:
            super().__init__()
            self.base = base

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.base(x)

    monkeypatch.setattr(graph_module, "_registered", [])
    model = ToyModel(seed=3)
    engine, graphs = graph_engine(model)
    request = Request([4, 5, 6], greedy(4))
    engine.submit(request)
    engine.run_until_done()
    assert graphs.captures and len(graphs)
    graph_module.register_adapter_wrapper(Wrapper)
    model.blocks[0]["o"] = Wrapper(model.blocks[0]["o"])  # a LoRA manager wraps a layer mid-service
    captures = graphs.captures
    rid = engine.submit(request)
    events = engine.run_until_done()
    assert len(graphs) == 0 and graphs.captures == captures  # eager from now on
    tokens = [e.token for e in events if e.request_id == rid and e.token is not None]
    assert (tokens, "length") == oracle(model, request, 96)


@pytest.mark.parametrize("overlap", [False, True])
def test_warm_up_captures_every_width_so_serving_captures_nothing_and_decodes_the_same(overlap):
    model = ToyModel(seed=4)
    engine, graphs = graph_engine(model, kv_positions=4 * 96, overlap=overlap)  # the store whole: no growth
    assert engine.warm_up() >= 0
    assert {width for (width, _), _, _ in graphs.keys} == set(engine.buckets)
    assert not engine.cache.sequences and not engine.has_work and engine.metrics.steps == 0
    captured = graphs.captures
    rng = random.Random(12)
    schedule = [(rng.randint(0, 20), Request(random_prompt(rng, 1, 40), greedy(rng.randint(1, 25)))) for _ in range(10)]
    outputs, ids = drive(engine, schedule)
    for index, (_, request) in enumerate(schedule):  # the warm-up's captured steps serve any length mix
        assert (outputs[ids[index]].tokens[0], outputs[ids[index]].finish_reasons[0]) == oracle(model, request, 96)
    assert graphs.captures == captured and graphs.replays > captured
    engine.assert_idle()


class _Cycle:
    """An object in a reference cycle with itself: only the cycle collector frees it."""

    def __init__(self) -> None:
        self.me = self


@pytest.mark.parametrize("graphed", [True, False])
def test_freeze_heap_collects_the_cycles_first_then_freezes_and_a_warm_engine_serves_the_same(graphed):
    # The collector's full passes then skip what was alive (one took 243 ms of the first step of the
    # SmolLM2-shape run on the H200); garbage in cycles is collected first, not frozen.
    model = ToyModel(seed=6)
    engine = graph_engine(model, kv_positions=4 * 96)[0] if graphed else Engine(model, max_seqs=4, capacity=96)
    engine.warm_up()
    garbage, alive = _Cycle(), {"kept": [1]}
    dead = weakref.ref(garbage)
    del garbage
    assert dead() is not None and any(o is alive for o in gc.get_objects())
    try:
        frozen = freeze_heap()
        assert 0 < gc.get_freeze_count() <= frozen  # frozen objects may still die by refcount; none join
        assert dead() is None  # collected before the freeze
        assert not any(o is alive for o in gc.get_objects())  # frozen: out of the collector's passes
        request = Request([3, 1, 4, 1, 5], greedy(12))
        rid = engine.submit(request)
        tokens = [e.token for e in engine.run_until_done() if e.request_id == rid and e.token is not None]
        assert (tokens, "length") == oracle(model, request, 96)
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0 and any(o is alive for o in gc.get_objects())


def test_warm_up_leaves_the_heap_unfrozen_so_a_dropped_model_in_a_reference_cycle_is_freed():
    # transformers' adapted modules hold bound methods of themselves; a library engine must not keep
    # such a model alive after its caller drops it (freezing is for processes that own their lifetime)
    model = ToyModel(seed=7)
    model.cycle = [model]  # a plain attribute: model -> list -> model
    engine, _ = graph_engine(model, kv_positions=4 * 96)
    engine.warm_up()
    assert gc.get_freeze_count() == 0
    dead = weakref.ref(model)
    engine.close()
    del engine, model
    gc.collect()
    assert dead() is None


_FROZEN_CYCLE_AT_EXIT = """
from batchkv.executor.graphs import freeze_heap
class Cycle:
    def __init__(self): self.me = self
    def __del__(self): print("finalised", flush=True)
cycle = Cycle()
freeze_heap()
del cycle  # garbage now, but frozen: only the exit's collection can free it
"""


def test_a_frozen_heap_is_unfrozen_at_exit_so_frozen_garbage_is_finalised_and_no_binding_reports_leaks():
    # Without it triton's nanobind module lists hundreds of "leaked" objects on every exit.
    done = subprocess.run([sys.executable, "-c", _FROZEN_CYCLE_AT_EXIT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["finalised"] and "leaked" not in done.stderr


def test_warm_up_refuses_an_engine_that_holds_sequences():
    engine, graphs = graph_engine(ToyModel(seed=5), kv_positions=4 * 96)
    rid = engine.submit(Request([1, 2, 3], greedy(4)))
    engine.step()
    with pytest.raises(StepError, match="holds no sequences"):
        engine.warm_up()
    outputs = {e.request_id for e in engine.run_until_done()}
    assert rid in outputs and not graphs.retired
