"""The engine against the eager oracle: every request's greedy tokens equal that request decoded
alone, whatever it was batched with (mixed lengths, arrivals, n > 1, stops, capacity, cancels)."""

from __future__ import annotations

import random

import pytest

from batchkv.errors import ConfigError, RequestError
from batchkv.executor import MAX_SAMPLE_ROWS, Engine, Request, SamplingParams, gather
from tests.executor_helpers import drive, greedy, oracle, random_prompt, working
from tests.toy_model import ToyModel


@pytest.fixture(scope="module")
def model():
    return ToyModel(seed=0)


def engine_for(model, **kwargs) -> Engine:
    opts = {"max_seqs": 4, "capacity": 48, "max_step_tokens": 16, "prefill_chunk": 8}
    return Engine(model, **(opts | kwargs))


def assert_matches_oracle(model, outputs, ids, schedule, capacity):
    for index, (_, request) in enumerate(schedule):
        tokens, reason = oracle(model, request, capacity)
        out = outputs[ids[index]]
        assert len(out.tokens) == request.params.n
        for sample in range(request.params.n):
            assert (out.tokens[sample], out.finish_reasons[sample]) == (tokens, reason), f"request {index}"


def test_greedy_tokens_equal_each_request_decoded_alone(model):
    rng = random.Random(1)
    schedule = []
    for i in range(12):
        prompt = random_prompt(rng, 1, 40)  # past the ring window (8) and several prefill chunks
        params = greedy(rng.randint(1, 24), n=3 if i in (2, 7) else 1)
        schedule.append((rng.randint(0, 20), Request(prompt, params)))
    engine = engine_for(model)
    outputs, ids = drive(engine, schedule)
    assert_matches_oracle(model, outputs, ids, schedule, capacity=48)
    reasons = {r for out in outputs.values() for r in out.finish_reasons}
    assert {"length", "capacity"} <= reasons  # both endings were exercised
    engine.assert_idle()


def test_stop_token_ends_the_sample_and_is_emitted_last(model):
    prompt = [5, 17, 33, 2]
    free_run, _ = oracle(model, Request(prompt, greedy(12)), capacity=48)
    stop = free_run[4]
    schedule = [(0, Request(prompt, greedy(12, stop_token_ids=(stop,)))), (1, Request([9, 9, 9], greedy(6)))]
    outputs, ids = drive(engine_for(model), schedule)
    out = outputs[ids[0]]
    assert out.finish_reasons == ["stop"] and out.tokens[0][-1] == stop
    assert out.tokens[0] == free_run[: free_run.index(stop) + 1]
    assert_matches_oracle(model, outputs, ids, schedule, capacity=48)


def test_a_sequence_reaching_capacity_finishes_with_capacity(model):
    capacity = 20
    schedule = [(0, Request(list(range(1, 15)), greedy(50))), (0, Request([3, 1, 4], greedy(5)))]
    outputs, ids = drive(engine_for(model, capacity=capacity), schedule)
    long = outputs[ids[0]]
    assert long.finish_reasons == ["capacity"]
    assert len(long.tokens[0]) == capacity - 14 + 1  # the last token is emitted, never written
    assert_matches_oracle(model, outputs, ids, schedule, capacity=capacity)


def test_n_samples_fork_after_the_prompt_into_their_own_columns(model):
    engine = engine_for(model)
    rid = engine.submit(Request(random_prompt(random.Random(3), 20, 20), greedy(6, n=3)))
    held = []
    for _ in working(engine):
        engine.step()
        held.append(len(engine.cache.sequences))
    assert held[0] == 1  # prefilling: one column (two more held back for the forks)
    assert 3 in held  # after the prompt: one column per sample
    engine.assert_idle()
    assert rid == 0


def test_cancelling_frees_columns_at_once_mid_prefill_and_mid_decode(model):
    rng = random.Random(4)
    schedule = [
        (0, Request(random_prompt(rng, 40, 40), greedy(10))),  # still prefilling at step 2
        (0, Request(random_prompt(rng, 3, 3), greedy(30, n=2))),  # decoding at step 6
        (0, Request(random_prompt(rng, 10, 20), greedy(12))),
        (3, Request(random_prompt(rng, 5, 30), greedy(12))),
    ]
    engine = engine_for(model)
    held, freed = [[]], []

    def watch(kind, value):
        if kind == "cancel":
            freed.append(len(held[-1]) - len(engine.cache.sequences))
        held.append(engine.cache.sequences)

    outputs, ids = drive(engine, schedule, cancels={2: [0], 6: [1]}, on_step=watch)
    assert freed == [1, 2]  # the prompt's column, then both forked samples' columns
    for index in (0, 1):
        out = outputs[ids[index]]
        assert out.finish_reasons == ["cancelled"] * schedule[index][1].params.n
        full, _ = oracle(model, schedule[index][1], 48)
        assert all(tokens == full[: len(tokens)] and len(tokens) < len(full) for tokens in out.tokens)
    for index in (2, 3):
        tokens, reason = oracle(model, schedule[index][1], 48)
        assert (outputs[ids[index]].tokens[0], outputs[ids[index]].finish_reasons[0]) == (tokens, reason)
    assert engine.metrics.finished["cancelled"] == 3
    assert not engine.cancel(ids[0])  # already gone
    engine.assert_idle()


def test_refusals_at_submit_leave_running_requests_untouched(model):
    rng = random.Random(5)
    schedule = [(0, Request(random_prompt(rng, 5, 30), greedy(10))) for _ in range(3)]
    engine = engine_for(model)
    ids = [engine.submit(request) for _, request in schedule]
    events = [event for _ in range(3) for event in engine.step()]
    before = (engine.cache.sequences, [engine.cache.pos(s) for s in engine.cache.sequences], engine._next_id)
    bad = [
        Request([], greedy(4)),
        Request(list(range(48)), greedy(4)),  # 48 + 1 > capacity 48
        Request([1, 2], greedy(4, n=5)),  # n above max_seqs
        Request([1, 97], greedy(4)),  # outside the vocabulary
    ]
    messages = []
    for request in bad:
        with pytest.raises(RequestError) as info:
            engine.submit(request)
        messages.append(str(info.value))
    assert "capacity is 48" in messages[1] and "max_seqs is 4" in messages[2] and "97" in messages[3]
    assert (engine.cache.sequences, [engine.cache.pos(s) for s in engine.cache.sequences], engine._next_id) == before
    assert engine.metrics.refused == 4
    outputs = gather(events + engine.run_until_done())
    for rid, (_, request) in zip(ids, schedule, strict=True):
        assert (outputs[rid].tokens[0], outputs[rid].finish_reasons[0]) == oracle(model, request, 48)


def test_rope_t_is_tracked_apart_from_the_kv_position(model):
    prompt = [11, 22, 33, 44, 55, 66]
    shifted = Request(prompt, greedy(10), rope_offset=1000)
    schedule = [(0, shifted), (0, Request(prompt, greedy(10)))]
    outputs, ids = drive(engine_for(model), schedule)
    assert_matches_oracle(model, outputs, ids, schedule, capacity=48)
    assert outputs[ids[0]].tokens != outputs[ids[1]].tokens  # the offset reached the model


def test_steps_respect_the_token_budget_chunk_size_and_the_sampling_rows(model):
    every_width = tuple(range(1, 513))  # no padding, so no prompt chunk is trimmed to a bucket
    engine = Engine(model, max_seqs=264, capacity=16, max_step_tokens=512, prefill_chunk=4, width_buckets=every_width,
                    prefill_budget=512)  # fmt: skip
    rng = random.Random(6)
    schedule = [(0, Request(random_prompt(rng, 2, 6), greedy(rng.randint(6, 9)))) for _ in range(264)]
    seen = []
    launch = engine.runner.launch

    def spy(batch, width, previous=None):
        seen.append((len(batch.seq_ids), len(batch.rows), width, max(batch.seq_ids.count(s) for s in batch.seq_ids)))
        return launch(batch, width, previous)

    engine.runner.launch = spy
    outputs, ids = drive(engine, schedule)
    assert_matches_oracle(model, outputs, ids, schedule, capacity=16)
    cap = engine.scheduler.sample_rows
    assert cap == min(MAX_SAMPLE_ROWS, 264) == 264
    assert max(rows for _, rows, _, _ in seen) == cap  # every resident sequence sampled in one step
    assert all(tokens <= 512 and rows <= cap and per_seq <= 4 for tokens, rows, _, per_seq in seen)
    assert all(width in engine.buckets and width >= tokens for tokens, _, width, _ in seen)


def test_storage_growth_mid_run_keeps_every_history(model):
    rng = random.Random(7)
    schedule = [(0, Request(random_prompt(rng, 3, 10), greedy(8))) for _ in range(2)]
    schedule.append((4, Request(random_prompt(rng, 30, 30), greedy(20))))  # 50 > 16 and 32 rows
    engine = engine_for(model, capacity=64, row_buckets=(16, 32), row_step=16)
    outputs, ids = drive(engine, schedule)
    assert_matches_oracle(model, outputs, ids, schedule, capacity=64)
    assert engine.metrics.growths >= 1 and engine.cache.pool_rows >= 50
    engine.metrics = engine.metrics.fresh()  # counting from now: the growths above are not counted again
    drive(engine, [(0, Request(random_prompt(rng, 3, 10), greedy(4)))])
    assert (engine.metrics.growths, engine.metrics.steps > 0) == (0, True)


def test_metrics_add_up(model):
    rng = random.Random(8)
    schedule = [(i, Request(random_prompt(rng, 1, 30), greedy(rng.randint(1, 12)))) for i in range(6)]
    engine = engine_for(model)
    outputs, _ = drive(engine, schedule)
    m, s = engine.metrics, engine.metrics.summary()
    generated = sum(len(t) for out in outputs.values() for t in out.tokens)
    assert s["generated_tokens"] == generated
    assert s["prefill_tokens"] == sum(len(r.prompt_ids) for _, r in schedule)
    assert s["decode_tokens"] == generated - len(schedule)  # every token but each last is fed back
    assert len(m.inter_token) == generated - len(schedule) and len(m.first_token) == len(schedule)
    assert s["steps"] == len(m.step_times) and 0 < s["occupancy"] <= 1
    assert s["tokens_per_s"] > 0 and s["itl_ms_p50"] <= s["itl_ms_p99"]
    assert sum(s["finished"].values()) == len(schedule) and s["captures"] == 0


def test_time_to_first_token_counts_each_request_once_whatever_its_samples(model):
    requests = [Request([3, 1, 4], greedy(4, n=3)), Request([2, 7], greedy(3)), Request([5], greedy(2, n=2))]
    schedule = list(enumerate(requests))
    engine = engine_for(model)
    outputs, _ = drive(engine, schedule)
    m = engine.metrics
    generated = sum(len(t) for out in outputs.values() for t in out.tokens)
    samples = sum(request.params.n for _, request in schedule)
    assert len(m.first_token) == len(schedule)  # a request's samples take their first tokens from one step
    assert len(m.inter_token) == generated - samples  # every later token of every sample


def test_bad_engine_configs_are_refused_with_the_rule(model):
    with pytest.raises(ConfigError, match="prefill_chunk"):
        Engine(model, max_step_tokens=8, prefill_chunk=16)
    with pytest.raises(ConfigError, match="width_buckets"):
        Engine(model, max_step_tokens=8, prefill_chunk=4, width_buckets=(1, 4))
    with pytest.raises(ConfigError, match="use_graphs=True needs CUDA"):
        Engine(model, max_step_tokens=8, prefill_chunk=4, use_graphs=True, device="cpu")
    with pytest.raises(RequestError):
        SamplingParams(top_p=0.0)


def test_prompt_chunks_are_trimmed_so_a_step_lands_on_a_width_bucket(model):
    engine = engine_for(
        model, capacity=64, max_step_tokens=64, prefill_chunk=64, width_buckets=(1, 2, 4, 8, 16, 32, 64)
    )
    assert engine.scheduler.buckets == engine.buckets
    prompt = random_prompt(random.Random(3), 40, 40)
    engine.submit(Request(prompt, greedy(4)))
    engine.scheduler.admit()
    batch = engine.scheduler.plan()
    assert len(batch.seq_ids) == 32  # 40 would pad to 64; 32 lands on a bucket, 8 go next step
    outputs, ids = drive(
        engine_for(model, capacity=64, max_step_tokens=64, prefill_chunk=64, width_buckets=(1, 2, 4, 8, 16, 32, 64)),
        [(0, Request(prompt, greedy(4)))],
    )
    assert_matches_oracle(model, outputs, ids, [(0, Request(prompt, greedy(4)))], capacity=64)


def test_a_request_with_more_samples_than_a_step_can_sample_is_refused_at_submit(model):
    engine = engine_for(model, max_seqs=8, max_step_tokens=4, prefill_chunk=4)
    with pytest.raises(RequestError, match="max_step_tokens=4"):
        engine.submit(Request([1, 2], greedy(4, n=5)))
    rid = engine.submit(Request([1], greedy(3, n=4)))  # 4 rows from a 1-token prompt: a width-4 step
    outputs = gather(engine.run_until_done())
    assert len(outputs[rid].tokens) == 4 and all(len(t) == 3 for t in outputs[rid].tokens)


def test_cancellation_events_survive_a_step_that_raises(model):
    engine = engine_for(model)
    first = engine.submit(Request([1, 2, 3], greedy(8)))
    request = Request([4, 5], greedy(8))
    second = engine.submit(request)
    events = engine.step()
    engine.cancel(first)
    launch = engine.runner.launch

    def broken(batch, width, previous=None):
        raise RuntimeError("injected forward failure")

    engine.runner.launch = broken
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    engine.runner.launch = launch
    events += engine.run_until_done()
    assert [e.request_id for e in events if e.finish_reason == "cancelled"] == [first]
    assert engine.metrics.finished["cancelled"] == 1
    tokens = [e.token for e in events if e.request_id == second and e.token is not None]
    assert (tokens, "length") == oracle(model, request, 48)  # the failed step left no trace
