"""Graph keys of speculative steps on the CPU: verify steps key on (width bucket, logits-rows bucket,
sampling), drafter steps on (width bucket, rows bucket; 0 for a step without blocks), each with
its cache's generation and the module fingerprint; one capture per key whatever the length mix,
tokens as without graphs."""

from __future__ import annotations

import random

from batchkv.executor import Engine, Request, SamplingParams, SpeculativeConfig
from batchkv.models import build_model
from batchkv.models.dflash import build_drafter
from tests.executor_helpers import drive
from tests.test_executor_graphs import RecordingGraphs


def test_draft_and_verify_steps_replay_one_graph_per_bucket_key():
    model = build_model("sensenova-u1-tiny", "cpu", seed=0)
    drafter = build_drafter(model, num_layers=1, target_layer_ids=(1, 3), block_size=4, seed=5)
    rng = random.Random(4)
    schedule = []
    for i in range(8):
        prompt = [rng.randrange(512) for _ in range(rng.randint(2, 30))]
        temperature = 0.9 if i % 3 == 0 else 0.0
        params = SamplingParams(max_new_tokens=rng.randint(2, 20), temperature=temperature, seed=i)
        schedule.append((rng.randint(0, 8), Request(prompt, params)))
    opts = {"max_seqs": 4, "capacity": 64, "max_step_tokens": 16, "prefill_chunk": 8, "row_buckets": (16, 32)}
    spec = SpeculativeConfig("dflash", block_size=4, drafter=drafter)
    eager = Engine(model, speculative=spec, **opts)
    expected, ids = drive(eager, schedule)
    engine = Engine(model, speculative=spec, **opts)
    verify, draft = RecordingGraphs(), RecordingGraphs()
    engine.runner.graphs, engine.speculator.proposer.runner.graphs = verify, draft
    got, got_ids = drive(engine, schedule)
    assert [got[i] for i in got_ids] == [expected[i] for i in ids]
    for graphs, buckets in ((verify, engine.buckets), (draft, (0, *engine.speculator.proposer.buckets))):
        keys = set(graphs.keys) | set(graphs.retired)
        assert graphs.captures == len(keys) and graphs.replays > graphs.captures
        for (head, _short), _generation, _fingerprint in keys:
            assert all(size in buckets for size in head[:2])
    drafter_rows = {head[1] for (head, _), _, _ in set(draft.keys) | set(draft.retired)}
    assert 0 in drafter_rows and len(drafter_rows) > 1  # context-only steps (rows 0) and drafting ones
    assert {sampling for ((_, _, sampling), _), _, _ in verify.keys} <= {True, False}
    assert {short for (_, short), _, _ in verify.keys} == {True}  # 8-token chunks and 4-token verify blocks
    assert {gen for _, gen, _ in draft.keys} == {engine.speculator.proposer.cache.generation}
    assert engine.metrics.spec_proposed > 0


def test_the_drafter_gets_its_own_graph_set_whenever_the_engine_has_one(monkeypatch):
    import batchkv.executor.speculative.dflash as dflash_module
    from batchkv.executor.speculative import build_speculator

    monkeypatch.setattr(dflash_module, "GraphSet", lambda device, **options: RecordingGraphs())
    model = build_model("sensenova-u1-tiny", "cpu", seed=0)
    drafter = build_drafter(model, num_layers=1, target_layer_ids=(1,), block_size=4, seed=5)
    spec = SpeculativeConfig("dflash", block_size=4, drafter=drafter)
    engine = Engine(model, max_seqs=2, capacity=64, max_step_tokens=16, prefill_chunk=8, speculative=spec)
    assert engine.speculator.proposer.runner.graphs is None  # eager engine, eager drafter
    speculator = build_speculator(
        spec,
        model,
        RecordingGraphs(),
        cache=engine.cache,
        metrics=engine.metrics,
        buckets=engine.buckets,
        prefill_chunk=8,
        role=engine.role,
    )  # empty graphs: falsy
    assert speculator.proposer.runner.graphs is not None and speculator.runner.graphs is not None
