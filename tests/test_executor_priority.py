"""Request priority: admission in priority order, and a step that takes only the most urgent
priority holding a column, the others paused with their tokens (equal to the oracle's); a less
urgent request that holds the memory a more urgent one waits for still runs (no deadlock), and a
prompt does not wait for a paused prefix donor."""

from __future__ import annotations

import random

import pytest

from batchkv.errors import RequestError
from batchkv.executor import Engine, Request
from batchkv.executor.prefix import PrefixCache
from tests.executor_helpers import drive, greedy, oracle, random_prompt
from tests.toy_model import ToyModel

CAPACITY = 48


@pytest.fixture(scope="module")
def model():
    return ToyModel(seed=0)


def record_steps(engine: Engine) -> list[dict[int, int]]:
    """Per step: request id -> tokens that step emitted."""
    steps: list[dict[int, int]] = []
    step = engine.step

    def spy():
        events = step()
        emitted: dict[int, int] = {}
        for event in events:
            if event.token is not None:
                emitted[event.request_id] = emitted.get(event.request_id, 0) + 1
        steps.append(emitted)
        return events

    engine.step = spy
    return steps


def assert_oracle(model, got, ids, schedule) -> None:
    for index, (_, request) in enumerate(schedule):
        assert (got[ids[index]].tokens[0], got[ids[index]].finish_reasons[0]) == oracle(model, request, CAPACITY)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_less_urgent_request_pauses_while_a_more_urgent_one_is_admitted(model, overlap):
    engine = Engine(model, max_seqs=4, capacity=CAPACITY, max_step_tokens=16, prefill_chunk=4, overlap=overlap)
    steps = record_steps(engine)
    rng = random.Random(3)
    background = Request(random_prompt(rng, 6, 6), greedy(30), priority=1)
    urgent = [Request(random_prompt(rng, 5, 9), greedy(8)) for _ in range(2)]
    schedule = [(0, background), (4, urgent[0]), (6, urgent[1])]
    got, ids = drive(engine, schedule)
    assert_oracle(model, got, ids, schedule)  # paused, then resumed: the same tokens
    engine.assert_idle()
    low, highs = ids[0], ids[1:]
    emitting = [i for i, emitted in enumerate(steps) if low in emitted]
    urgent_steps = [i for i, emitted in enumerate(steps) if any(h in emitted for h in highs)]
    assert emitting[0] < urgent_steps[0]  # it ran before they came
    # from the first urgent token to the last, the background request emitted nothing (with overlap one
    # step it was already in may still land after the urgent prompt's first chunk)
    late = 1 if overlap else 0
    assert not [i for i in emitting if urgent_steps[0] + late < i <= urgent_steps[-1]]
    assert emitting[-1] > urgent_steps[-1]  # and it finished after them


def test_waiting_requests_are_admitted_in_priority_order_fifo_within_one(model):
    engine = Engine(model, max_seqs=1, capacity=CAPACITY, max_step_tokens=8, prefill_chunk=8)
    rng = random.Random(4)
    priorities = [2, 0, 1, 0, 2]
    schedule = [(0, Request(random_prompt(rng, 3, 5), greedy(3), priority=p)) for p in priorities]
    firsts: dict[int, int] = {}
    steps = record_steps(engine)
    got, ids = drive(engine, schedule)
    assert_oracle(model, got, ids, schedule)
    for i, emitted in enumerate(steps):
        for rid in emitted:
            firsts.setdefault(rid, i)
    order = sorted(range(len(schedule)), key=lambda index: firsts[ids[index]])
    assert order == [1, 3, 2, 0, 4]  # priority 0 in arrival order, then 1, then 2 in arrival order


def test_a_less_urgent_request_holding_the_memory_runs_while_a_more_urgent_one_waits(model):
    engine = Engine(model, max_seqs=1, capacity=CAPACITY, max_step_tokens=8, prefill_chunk=8)
    rng = random.Random(5)
    schedule = [(0, Request(random_prompt(rng, 4, 4), greedy(12), priority=5)),
                (3, Request(random_prompt(rng, 4, 4), greedy(4), priority=-1))]  # fmt: skip
    got, ids = drive(engine, schedule)  # no column for the urgent one until the background one ends
    assert_oracle(model, got, ids, schedule)
    engine.assert_idle()


def test_a_prompt_does_not_wait_for_a_paused_less_urgent_prefix_donor(model):
    engine = Engine(model, max_seqs=4, capacity=CAPACITY, max_step_tokens=8, prefill_chunk=4, prefix_cache=True)
    steps = record_steps(engine)
    rng = random.Random(6)
    shared = random_prompt(rng, 24, 24)
    runner = Request(random_prompt(rng, 2, 2), greedy(30))
    donor = Request([*shared, 1, 2], greedy(2), priority=1)  # admitted, paused behind the runner
    asker = Request([*shared, 3, 4], greedy(2))  # shares 24 tokens the donor has not written
    schedule = [(0, runner), (0, donor), (3, asker)]
    got, ids = drive(engine, schedule)
    assert_oracle(model, got, ids, schedule)
    last = {rid: max(i for i, emitted in enumerate(steps) if rid in emitted) for rid in ids}
    assert last[ids[2]] < last[ids[0]]  # the asker finished while the runner still ran: it did not wait
    assert isinstance(engine.scheduler.prefix, PrefixCache)


@pytest.mark.parametrize("priority", [1.5, True, "1", 2**31, -(2**31) - 1])
def test_a_priority_that_is_not_an_int32_is_refused(priority):
    with pytest.raises(RequestError, match="priority"):
        Request([1, 2, 3], greedy(2), priority=priority)


def test_priority_bounds_are_accepted():
    assert Request([1], priority=2**31 - 1).priority == 2**31 - 1
    assert Request([1], priority=-(2**31)).priority == -(2**31)
