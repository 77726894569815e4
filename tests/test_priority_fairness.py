"""Admission and step packing across priorities and prefix waits, as traces of planned steps held
against a plain-Python statement of the rule: a request waiting for a donor's prefix lets those
behind it in; a step carries only the most urgent priority holding a column (no less urgent
prompt chunk beside urgent samples); urgent samples that a step cannot all take take turns; and
with only paused samples running, an urgent prompt has the whole step, not the prefill budget.
Every request's tokens against the recomputing oracle."""

from __future__ import annotations

import itertools
import random

import pytest

from batchkv.executor import Engine, Request, gather
from tests.executor_helpers import drive, greedy, oracle, random_prompt
from tests.toy_model import ToyModel

CAPACITY = 96


@pytest.fixture(scope="module")
def model():
    return ToyModel(seed=0)


def record_plans(e: Engine) -> list[dict]:
    """Per planned step: decode rows [(request id, sample index)] and prompt chunks
    [(request id, tokens)], with each one's priority."""
    plans: list[dict] = []
    plan = e.scheduler.plan

    def spy():
        batch = plan()
        if batch is not None:
            decoding = batch.samples[: batch.decode_tokens]
            plans.append({
                "decode": [(s.owner.id, s.index, s.owner.request.priority) for s in decoding],
                "prefill": [(state.id, chunk, state.request.priority) for state, chunk in batch.prefill],
            })  # fmt: skip
        return batch

    e.scheduler.plan = spy
    return plans


def assert_oracle(model, got, ids, schedule) -> None:
    for index, (_, request) in enumerate(schedule):
        assert (got[ids[index]].tokens[0], got[ids[index]].finish_reasons[0]) == oracle(model, request, CAPACITY)


def test_a_request_waiting_for_a_donors_prefix_lets_the_requests_behind_it_in(model):
    e = Engine(model, max_seqs=4, capacity=CAPACITY, max_step_tokens=32, prefill_chunk=8, prefix_cache=True)
    rng = random.Random(0)
    donor_prompt = [1, *random_prompt(rng, 63, 63)]
    donor = Request(donor_prompt, greedy(4))
    waiter = Request([*donor_prompt[:48], 2, 3], greedy(4))  # 48 tokens the donor has not written yet
    other = Request([4, *random_prompt(rng, 5, 5)], greedy(4))  # shares nothing
    ids = [e.submit(r) for r in (donor, waiter, other)]
    events = e.step()
    assert [state.id for state in e.scheduler.waiting] == [ids[1]]  # only the waiter waits
    admitted = {state.id for state in e.scheduler.prefilling} | {s.owner.id for s in e.scheduler.running}
    assert admitted == {ids[0], ids[2]}
    got = gather(events + e.run_until_done())
    assert_oracle(model, got, ids, [(0, donor), (0, waiter), (0, other)])
    assert e.metrics.prefix_reused > 48 - 8  # the waiter cloned what the donor had written of the 48
    e.assert_idle()


def test_a_less_urgent_prompt_is_not_prefilled_while_urgent_samples_run(model):
    e = Engine(model, max_seqs=4, capacity=CAPACITY, max_step_tokens=16, prefill_chunk=4)
    plans = record_plans(e)
    rng = random.Random(1)
    urgent = Request(random_prompt(rng, 5, 5), greedy(12))
    background = Request(random_prompt(rng, 30, 30), greedy(4), priority=1)
    schedule = [(0, urgent), (3, background)]  # the background prompt arrives while urgent decodes
    got, ids = drive(e, schedule)
    assert_oracle(model, got, ids, schedule)
    # the rule: each step's rows are of one priority, the most urgent holding a column
    for step, plan in enumerate(plans):
        priorities = {p for *_, p in plan["decode"]} | {p for *_, p in plan["prefill"]}
        assert len(priorities) == 1, f"step {step}: {plan}"
    background_steps = [i for i, plan in enumerate(plans) if any(r == ids[1] for r, *_ in plan["prefill"])]
    urgent_steps = [i for i, plan in enumerate(plans) if any(r == ids[0] for r, *_ in plan["decode"])]
    assert min(background_steps) > max(urgent_steps)  # it waited for the urgent request to finish
    e.assert_idle()


def test_urgent_samples_a_step_cannot_all_take_take_turns_while_a_less_urgent_one_is_paused(model):
    e = Engine(model, max_seqs=4, capacity=CAPACITY, max_step_tokens=2, prefill_chunk=2)
    plans = record_plans(e)
    rng = random.Random(2)
    background = Request(random_prompt(rng, 2, 2), greedy(30), priority=1)
    urgent = [Request(random_prompt(rng, 2, 2), greedy(8)) for _ in range(3)]
    schedule = [(0, background)] + [(3, r) for r in urgent]
    got, ids = drive(e, schedule)
    assert_oracle(model, got, ids, schedule)
    decoded = [{r for r, *_ in plan["decode"]} for plan in plans]
    steps = {r: [i for i, rows in enumerate(decoded) if r in rows] for r in ids[1:]}
    # from the step where the last of them first decodes to the last step of the first to finish,
    # all three are running and each step takes two
    window = decoded[max(s[0] for s in steps.values()) : min(s[-1] for s in steps.values()) + 1]
    assert len(window) >= 4 and all(len(rows) == 2 and ids[0] not in rows for rows in window), window
    # round-robin (the model): the one a step leaves out is the first the next step takes
    for step, (rows, following) in enumerate(itertools.pairwise(window)):
        assert set(ids[1:]) - rows <= following, f"step {step} of {window}: one left out twice running"
    e.assert_idle()


def test_an_urgent_prompt_beside_only_paused_samples_takes_the_whole_step_not_the_prefill_budget(model):
    e = Engine(model, max_seqs=4, capacity=CAPACITY, max_step_tokens=16, prefill_chunk=16, prefill_budget=4)
    plans = record_plans(e)
    rng = random.Random(3)
    background = Request(random_prompt(rng, 3, 3), greedy(20), priority=1)
    urgent = Request(random_prompt(rng, 16, 16), greedy(3))
    schedule = [(0, background), (3, urgent)]
    got, ids = drive(e, schedule)
    assert_oracle(model, got, ids, schedule)
    chunks = [chunk for plan in plans for r, chunk, _ in plan["prefill"] if r == ids[1]]
    assert chunks == [16]  # min(prompt, prefill_chunk, max_step_tokens): one step, not four of 4
    e.assert_idle()
