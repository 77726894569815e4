"""Overlap (step N+1 planned and queued while step N runs) against the same engine without it and
the eager oracle: the same tokens and finishes whatever happens at each point of the pipeline
(arrivals, cancellations, stops seen one step late, forks, capacity and length finishes, a forward
that raises with a step in flight), every column freed, events in order."""

from __future__ import annotations

import random

import pytest
import torch

from batchkv.errors import ConfigError
from batchkv.executor import Engine, Request, SamplingParams, SpeculativeConfig, gather
from batchkv.executor.pipeline import Pipeline
from tests.executor_helpers import drive, greedy, oracle, random_prompt
from tests.toy_model import ToyModel

CAPACITY = 48


@pytest.fixture(scope="module")
def model():
    return ToyModel(seed=0)


def engine_for(model, overlap, **kwargs) -> Engine:
    opts = {"max_seqs": 4, "capacity": CAPACITY, "max_step_tokens": 16, "prefill_chunk": 8}
    return Engine(model, overlap=overlap, **(opts | kwargs))


def record_launches(engine: Engine) -> list[dict]:
    """Every launched step's plan, as the runner saw it (decode rows, device-fed rows, prompts)."""
    seen: list[dict] = []
    launch = engine.runner.launch

    def spy(batch, width, previous=None):
        tokens = launch(batch, width, previous)
        decode = batch.samples[: batch.decode_tokens]
        seen.append({
            "decode": [(s.owner.id, s.index) for s in decode],
            "from_device": [(s.owner.id, s.index) for s, src in zip(decode, batch.token_src, strict=False) if src >= 0],
            "completed": [state.id for state in batch.completed],
            "prefill": {state.id: chunk for state, chunk in batch.prefill},
        })  # fmt: skip
        return tokens

    engine.runner.launch = spy
    return seen


def stop_after(model, prompt, k: int) -> int:
    """A stop id that the greedy oracle emits as its k-th token (0-based) and not before."""
    free, _ = oracle(model, Request(prompt, greedy(k + 1)), CAPACITY)
    assert free[k] not in free[:k], "pick another prompt: the token repeats"
    return free[k]


def mixed_schedule(model, seed: int) -> list[tuple[int, Request]]:
    """Staggered arrivals past the ring window and several chunks, n > 1, stops, capacity finishes."""
    rng = random.Random(seed)
    schedule = []
    for i in range(12):
        prompt = random_prompt(rng, 1, 40)
        stops = ()
        if i % 3 == 0:
            free, _ = oracle(model, Request(prompt, greedy(6)), CAPACITY)
            stops = (free[rng.randrange(len(free))],)
        params = greedy(rng.randint(1, 24), n=3 if i in (2, 7) else 1, stop_token_ids=stops)
        schedule.append((rng.randint(0, 20), Request(prompt, params)))
    return schedule


def assert_in_order(events) -> None:
    """Per sample: tokens, then exactly one finish, nothing after it."""
    finished = set()
    for event in events:
        key = (event.request_id, event.sample)
        assert key not in finished, f"event after the finish of {key}: {event}"
        if event.finish_reason is not None:
            finished.add(key)


@pytest.mark.parametrize("seed", [1, 2])
def test_greedy_tokens_with_overlap_equal_tokens_without_it_and_the_oracle(model, seed):
    schedule = mixed_schedule(model, seed)
    plain, fast = engine_for(model, False), engine_for(model, True)
    launches = record_launches(fast)
    expected, plain_ids = drive(plain, schedule)
    got, fast_ids = drive(fast, schedule)
    assert not plain.overlap and fast.overlap
    for index, (_, request) in enumerate(schedule):
        assert got[fast_ids[index]] == expected[plain_ids[index]], f"request {index}"
        tokens, reason = oracle(model, request, CAPACITY)
        if reason != "stop" or not request.params.stop_token_ids:
            assert got[fast_ids[index]].tokens == [tokens] * request.params.n
    reasons = {r for out in got.values() for r in out.finish_reasons}
    assert {"length", "capacity", "stop"} <= reasons
    assert sum(len(step["from_device"]) for step in launches) > 0  # decode rows were fed on the device
    fast.assert_idle()
    plain.assert_idle()


def test_sampled_tokens_with_overlap_equal_tokens_without_it(model):
    rng = random.Random(3)
    schedule = []
    for i in range(10):
        params = SamplingParams(
            max_new_tokens=rng.randint(1, 20), temperature=0.9, top_k=rng.choice([0, 12]), top_p=0.95,
            seed=i, n=rng.choice([1, 2, 3]), stop_token_ids=(rng.randrange(97), rng.randrange(97)),
        )  # fmt: skip
        schedule.append((rng.randint(0, 15), Request(random_prompt(rng, 1, 30), params)))
    expected, plain_ids = drive(engine_for(model, False), schedule)
    got, fast_ids = drive(engine_for(model, True), schedule)
    assert [got[i] for i in fast_ids] == [expected[i] for i in plain_ids]
    assert "stop" in {r for out in got.values() for r in out.finish_reasons}


def test_a_stop_seen_one_step_late_discards_the_planned_token_and_frees_the_column(model):
    prompt = [5, 17, 33, 2]
    stop = stop_after(model, prompt, 3)
    first = Request(prompt, greedy(12, stop_token_ids=(stop,)))
    second = Request([9, 9, 9], greedy(5))
    schedule = [(0, first), (0, second)]
    fast = engine_for(model, True, max_seqs=1)  # the second request needs the stopped one's column
    launches = record_launches(fast)
    got, ids = drive(fast, schedule)
    assert (got[ids[0]].tokens[0], got[ids[0]].finish_reasons[0]) == oracle(model, first, CAPACITY)
    assert got[ids[0]].tokens[0][-1] == stop and len(got[ids[0]].tokens[0]) == 4
    assert (got[ids[1]].tokens[0], got[ids[1]].finish_reasons[0]) == oracle(model, second, CAPACITY)
    decoded = [step["decode"].count((ids[0], 0)) for step in launches]
    assert sum(decoded) == 4  # 3 rows fed tokens 1-3, and one more was planned before the stop was read
    fast.assert_idle()


def test_the_last_request_ending_on_a_stop_keeps_has_work_until_the_step_in_flight_is_finished(model):
    prompt = [5, 17, 33, 2]
    request = Request(prompt, greedy(12, stop_token_ids=(stop_after(model, prompt, 3),)))
    engine = engine_for(model, True)
    rid = engine.submit(request)
    seen = []  # (has_work, a step in flight) after each step
    for _ in range(20):
        if not engine.has_work:
            break
        events = engine.step()
        seen.append((engine.has_work, engine.pipeline.in_flight is not None))
    else:
        pytest.fail(f"20 steps and still has_work: {seen}")
    assert events == []  # the last step only discarded the token planned past the stop
    assert seen[-2] == (True, True) and seen[-1] == (False, False)  # the stop was read with a step still in flight
    engine.assert_idle()
    again = engine_for(model, True)
    again.submit(request)
    got = gather(again.run_until_done(), {rid: 1})[rid]
    assert again.pipeline.in_flight is None
    again.assert_idle()
    assert (got.tokens[0], got.finish_reasons[0]) == oracle(model, request, CAPACITY)
    assert got.finish_reasons[0] == "stop"


def test_length_and_capacity_finishes_are_never_scheduled_past_and_free_the_column_at_launch(model):
    capacity = 20
    schedule = [
        (0, Request([3, 1, 4], greedy(3))),  # length: tokens 1..3, two decode rows
        (0, Request(list(range(1, 15)), greedy(50))),  # capacity: 20 - 14 + 1 tokens
        (0, Request([2, 7, 1, 8], greedy(4))),
    ]
    starts = {}
    for overlap in (False, True):
        engine = engine_for(model, overlap, max_seqs=1, capacity=capacity)
        launches = record_launches(engine)
        got, ids = drive(engine, schedule)
        for index, (_, request) in enumerate(schedule):
            tokens, reason = oracle(model, request, capacity)
            assert (got[ids[index]].tokens[0], got[ids[index]].finish_reasons[0]) == (tokens, reason)
            rows = sum(step["decode"].count((ids[index], 0)) for step in launches)
            assert rows == len(tokens) - 1  # every token but the last is fed back, none more
        # The next request's prompt rides in the step right after the last token's step.
        starts[overlap] = [next(i for i, step in enumerate(launches) if rid in step["prefill"]) for rid in ids]
        engine.assert_idle()
    assert starts[True] == starts[False]


def test_forks_decode_in_the_step_after_the_prompt_from_device_tokens(model):
    prompt = random_prompt(random.Random(4), 20, 20)
    request = Request(prompt, greedy(5, n=3))
    engine = engine_for(model, True)
    launches = record_launches(engine)
    rid = engine.submit(request)
    outputs = gather(engine.run_until_done())
    tokens, reason = oracle(model, request, CAPACITY)
    assert outputs[rid].tokens == [tokens] * 3 and outputs[rid].finish_reasons == [reason] * 3
    done = next(i for i, step in enumerate(launches) if rid in step["completed"])
    assert sorted(launches[done + 1]["from_device"]) == [(rid, 0), (rid, 1), (rid, 2)]
    engine.assert_idle()


def cancel_schedule(model) -> list[tuple[int, Request]]:
    rng = random.Random(5)
    return [
        (0, Request(random_prompt(rng, 30, 30), greedy(14))),  # holds columns while the others wait
        (0, Request(random_prompt(rng, 12, 12), greedy(6))),
        (0, Request(random_prompt(rng, 5, 5), greedy(20))),
        (1, Request(random_prompt(rng, 18, 18), greedy(7, n=2))),  # the one cancelled: waits, prefills, forks
        (2, Request(random_prompt(rng, 4, 9), greedy(9))),
    ]


@pytest.mark.parametrize("at", range(1, 22))
def test_cancelling_at_every_point_of_the_pipeline(model, at):
    schedule = cancel_schedule(model)
    engine = engine_for(model, True, max_seqs=4)
    events: list = []
    step, ids, answer = 0, [], None
    while step < 60 and (engine.has_work or len(ids) < len(schedule)):
        for arrival, request in schedule:
            if arrival == step:
                ids.append(engine.submit(request))
        if step == at:
            live_before = ids[3] in engine.scheduler.live
            answer = engine.cancel(ids[3])
            assert answer == live_before
        events += engine.step()
        step += 1
    assert_in_order(events)
    outputs = gather(events, {rid: r.params.n for rid, (_, r) in zip(ids, schedule, strict=True)})
    full, reason = oracle(model, schedule[3][1], CAPACITY)
    target = outputs[ids[3]]
    if answer:
        assert target.finish_reasons == ["cancelled", "cancelled"]
        assert all(tokens == full[: len(tokens)] and len(tokens) < len(full) for tokens in target.tokens)
    else:  # already finished: cancel changed nothing
        assert target.tokens == [full, full] and target.finish_reasons == [reason, reason]
    for index in (0, 1, 2, 4):
        tokens, reason = oracle(model, schedule[index][1], CAPACITY)
        assert (outputs[ids[index]].tokens[0], outputs[ids[index]].finish_reasons[0]) == (tokens, reason)
    engine.assert_idle()


def test_cancelling_covers_every_stage_of_a_request():
    """The points the parametrised test above cancels at include every stage of the request."""
    model = ToyModel(seed=0)
    schedule = cancel_schedule(model)
    engine = engine_for(model, True, max_seqs=4)
    ids, stages = [], []
    for step in range(22):
        for arrival, request in schedule:
            if arrival == step:
                ids.append(engine.submit(request))
        if len(ids) > 3:
            state = engine.scheduler.live.get(ids[3])
            if state is None:
                stages.append("finished")
            elif state in engine.scheduler.waiting:
                stages.append("waiting")
            elif state.remaining:
                stages.append("prefilling")
            else:
                pending = any(s.pending for s in state.samples)
                exhausted = all(s.seq < 0 for s in state.samples)
                stages.append("last token in flight" if exhausted else "token in flight" if pending else "decoding")
        engine.step()
    assert {"waiting", "prefilling", "token in flight", "last token in flight", "finished"} <= set(stages)


@pytest.mark.parametrize("fail_at", [2, 3, 5, 8, 13, 21])
def test_a_forward_that_raises_with_a_step_in_flight_leaves_no_trace(model, fail_at):
    schedule = mixed_schedule(model, 4)
    expected, plain_ids = drive(engine_for(model, False), schedule)
    calls = [0]

    class Faulty:
        """The toy model, raising once from its forward at call `fail_at`."""

        def __init__(self) -> None:
            self.inner, self.vocab_size, self.device = model, model.vocab_size, model.device

        def cache_spec(self) -> dict:
            return model.cache_spec()

        def __call__(self, *args):
            calls[0] += 1
            if calls[0] == fail_at:
                raise RuntimeError("injected forward failure")
            return model(*args)

    engine = engine_for(Faulty(), True)
    order = sorted(range(len(schedule)), key=lambda i: schedule[i][0])
    ids, events, step, raised, in_flight = [-1] * len(schedule), [], 0, 0, None
    while step < 400 and (engine.has_work or min(ids) < 0):
        for i in order:
            if schedule[i][0] == step and ids[i] < 0:
                ids[i] = engine.submit(schedule[i][1])
        try:
            events += engine.step()
        except RuntimeError:
            raised += 1
            in_flight = engine.pipeline.in_flight
            assert engine.cache.prepared  # declared and prepared, never committed
        step += 1
    assert raised == 1 and in_flight is not None  # the failure hit a launch with a step in flight
    assert_in_order(events)
    outputs = gather(events, {ids[i]: r.params.n for i, (_, r) in enumerate(schedule)})
    for index in range(len(schedule)):
        assert outputs[ids[index]] == expected[plain_ids[index]], f"request {index}"
    engine.assert_idle()


def test_speculating_engines_run_without_overlap(model):
    with pytest.raises(ConfigError, match="overlap=True with speculative"):
        engine_for(model, True, speculative=SpeculativeConfig("ngram", block_size=4))
    with pytest.raises(ConfigError, match="overlap is 'yes'"):
        engine_for(model, "yes")
    spec = engine_for(model, "auto", speculative=SpeculativeConfig("ngram", block_size=4))
    assert not spec.overlap and not engine_for(model, "auto").overlap  # auto: on CUDA only
    schedule = mixed_schedule(model, 5)
    expected, plain_ids = drive(engine_for(model, True), schedule)
    got, spec_ids = drive(spec, schedule)
    assert [got[i] for i in spec_ids] == [expected[i] for i in plain_ids]
    spec.assert_idle()


def test_auto_overlaps_on_cuda_only_and_never_while_speculating():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")  # device objects only: no GPU is needed
    assert Pipeline.for_engine("auto", speculating=False, device=cuda).overlap
    assert not Pipeline.for_engine("auto", speculating=True, device=cuda).overlap
    assert not Pipeline.for_engine("auto", speculating=False, device=cpu).overlap
    assert Pipeline.for_engine(True, speculating=False, device=cpu).overlap
    assert not Pipeline.for_engine(False, speculating=False, device=cuda).overlap
    assert not Pipeline.for_engine(False, speculating=True, device=cuda).overlap


def test_the_prefill_budget_caps_prompt_tokens_per_step(model):
    rng = random.Random(6)
    schedule = [(0, Request(random_prompt(rng, 20, 40), greedy(rng.randint(2, 8)))) for _ in range(4)]
    steps = {}
    for budget in (3, None):
        engine = engine_for(model, True, prefill_budget=budget)
        launches = record_launches(engine)
        got, ids = drive(engine, schedule)
        for index, (_, request) in enumerate(schedule):
            assert (got[ids[index]].tokens[0], got[ids[index]].finish_reasons[0]) == oracle(model, request, CAPACITY)
        decoding = [sum(step["prefill"].values()) for step in launches if step["decode"]]
        alone = [sum(step["prefill"].values()) for step in launches if not step["decode"]]
        # None: half the 16-token step, at least a chunk (8; steps trimmed to a width bucket may take fewer)
        assert max(decoding) == 3 if budget else 3 < max(decoding) <= 8
        assert max(alone) == 16  # nothing decodes: the whole step
        steps[budget] = len(launches)
    assert steps[3] > steps[None]
    with pytest.raises(ConfigError, match="prefill_budget"):
        engine_for(model, True, prefill_budget=0)


def test_storage_growth_with_a_step_in_flight_keeps_every_history(model):
    rng = random.Random(6)
    schedule = [(rng.randint(0, 8), Request(random_prompt(rng, 3, 8), greedy(rng.randint(2, 8)))) for _ in range(8)]
    schedule.append((5, Request(random_prompt(rng, 20, 20), greedy(10))))  # 29 positions: past 16 rows
    schedule.append((12, Request(random_prompt(rng, 30, 30), greedy(18))))  # 47: past 32 rows
    rows = {"row_buckets": (16, 32), "row_step": 16}
    expected, plain_ids = drive(engine_for(model, False, **rows), schedule)
    fast = engine_for(model, True, **rows)
    grew_in_flight = []

    def watch(verb):  # growth happens at admission (seq_new places the extent) or in prepare_step
        def watched(*args, **kwargs):
            generation = fast.cache.generation
            result = verb(*args, **kwargs)
            if fast.cache.generation != generation:
                grew_in_flight.append(fast.pipeline.in_flight is not None)
            return result

        return watched

    fast.cache.seq_new, fast.cache.prepare_step = watch(fast.cache.seq_new), watch(fast.cache.prepare_step)
    got, ids = drive(fast, schedule)
    assert [got[i] for i in ids] == [expected[i] for i in plain_ids]
    assert fast.metrics.growths == len(grew_in_flight) >= 2 and grew_in_flight.count(True) >= 2, grew_in_flight
    fast.assert_idle()
