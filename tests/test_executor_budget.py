"""The prefill budget: its default, and that it binds every step while samples are running (and
only then), with tokens equal to the oracle's; trimming a step to a width bucket never starves a
waiting prompt."""

from __future__ import annotations

import random

import pytest

from batchkv.executor import Engine, Request
from batchkv.executor.scheduler import default_prefill_budget
from tests.executor_helpers import drive, greedy, oracle, random_prompt
from tests.toy_model import ToyModel

CAPACITY = 48


@pytest.fixture(scope="module")
def model():
    return ToyModel(seed=0)


def spy_plans(engine: Engine, view) -> list:
    """`view(samples running when the step was planned, batch)` of every planned step."""
    seen: list = []
    plan = engine.scheduler.plan

    def spy():
        running = len(engine.scheduler.running)
        batch = plan()
        if batch is not None:
            seen.append(view(running, batch))
        return batch

    engine.scheduler.plan = spy
    return seen


def record_plans(engine: Engine) -> list[tuple[int, int, int]]:
    """(samples running when the step was planned, decode rows, prompt tokens) of every launched step."""
    return spy_plans(engine, lambda running, batch: (running, batch.decode_tokens,
                                                     sum(chunk for _, chunk in batch.prefill)))  # fmt: skip


def assert_oracle(model, engine: Engine, schedule) -> None:
    got, ids = drive(engine, schedule)
    for index, (_, request) in enumerate(schedule):
        for sample in range(request.params.n):
            expected = oracle(model, request, CAPACITY)
            assert (got[ids[index]].tokens[sample], got[ids[index]].finish_reasons[sample]) == expected
    engine.assert_idle()


def test_the_default_is_half_the_step_at_least_one_chunk():
    assert default_prefill_budget(1024, 512) == 512
    assert default_prefill_budget(16, 2) == 8  # half the step
    assert default_prefill_budget(16, 12) == 12  # at least one chunk
    assert default_prefill_budget(5, 1) == 2
    assert default_prefill_budget(1, 1) == 1


@pytest.mark.parametrize("overlap", [False, True])
def test_the_default_binds_steps_while_samples_run_and_not_the_ramp(model, overlap):
    engine = Engine(model, max_seqs=8, capacity=CAPACITY, max_step_tokens=16, prefill_chunk=2,
                    width_buckets=tuple(range(1, 17)), overlap=overlap)  # fmt: skip
    assert engine.scheduler.prefill_budget == 8
    plans = record_plans(engine)
    rng = random.Random(2)
    schedule = [(0, Request(random_prompt(rng, 1, 1), greedy(30)))]  # one decoder from the first steps
    schedule += [(2, Request(random_prompt(rng, 12, 12), greedy(2))) for _ in range(6)]
    schedule += [(40, Request(random_prompt(rng, 12, 12), greedy(2))) for _ in range(2)]  # after all finished
    assert_oracle(model, engine, schedule)
    assert max(prompt for running, _, prompt in plans if running) == 8  # four 2-token chunks, not 15
    assert max(prompt for running, _, prompt in plans if not running) == 4  # the late pair together


def test_a_prompt_that_would_take_every_sampling_row_does_not_lift_the_budget(model):
    # three decoding samples, then a prompt with n = 4 = the step's sampling rows: planning used to
    # hand it every row (decode 0), and a step without decode rows ignored the budget
    engine = Engine(model, max_seqs=12, capacity=CAPACITY, max_step_tokens=4, prefill_chunk=4, prefill_budget=1)
    plans = record_plans(engine)
    rng = random.Random(1)
    schedule = [(0, Request(random_prompt(rng, 1, 1), greedy(20))) for _ in range(3)]
    schedule += [(3, Request(random_prompt(rng, 3, 3), greedy(2, n=4)))]
    assert_oracle(model, engine, schedule)
    assert all(prompt <= 1 for running, _, prompt in plans if running)
    # the samples wait out only the step that finishes the prompt (its 4 samples take every row)
    assert [prompt for running, decode, prompt in plans if running and not decode] == [1]


@pytest.mark.parametrize("step,chunk", [(1, 1), (2, 1), (3, 3), (5, 2), (16, 8), (16, 16)])
@pytest.mark.parametrize("overlap", [False, True])
def test_small_and_equal_step_and_chunk_budgets_keep_the_oracles_tokens(model, step, chunk, overlap):
    rng = random.Random(step * 7 + chunk)
    schedule = [
        (
            rng.randint(0, 6),
            Request(random_prompt(rng, 1, 20), greedy(rng.randint(1, 6), n=min(2, step) if i % 3 == 0 else 1)),
        )
        for i in range(6)
    ]
    engine = Engine(model, max_seqs=8, capacity=CAPACITY, max_step_tokens=step, prefill_chunk=chunk, overlap=overlap)
    assert engine.scheduler.prefill_budget == default_prefill_budget(step, chunk) <= step
    plans = record_plans(engine)
    assert_oracle(model, engine, schedule)
    assert all(prompt <= engine.scheduler.prefill_budget for running, _, prompt in plans if running)


@pytest.mark.parametrize("overlap", [False, True])
def test_decode_rows_that_fill_a_bucket_still_leave_a_waiting_prompt_its_chunk(model, overlap):
    # four decoding samples fill the 4-wide bucket exactly, and with the prompt's 8-token chunk the step would be
    # 12 wide, between buckets 4 and 16: trimming the step to a bucket must not trim the chunk to nothing (the
    # prompt would wait for the decoders to finish)
    engine = Engine(model, max_seqs=5, capacity=CAPACITY, max_step_tokens=16, prefill_chunk=8,
                    width_buckets=(1, 2, 4, 16), overlap=overlap)  # fmt: skip
    plans = record_plans(engine)
    rng = random.Random(4)
    schedule = [(0, Request(random_prompt(rng, 1, 1), greedy(20))) for _ in range(4)]
    schedule.append((3, Request(random_prompt(rng, 12, 12), greedy(3))))
    assert_oracle(model, engine, schedule)
    prompt_tokens = [prompt for _, _, prompt in plans]
    assert prompt_tokens[:6] == [4, 0, 0, 8, 4, 0]  # its two chunks in the two steps after it arrives
    assert [decode for _, decode, prompt in plans if prompt == 8] == [4]  # beside all four decode rows


def record_chunks(engine: Engine) -> list[list[tuple[int, int]]]:
    """Per planned step, its prompt chunks as (prompt length, chunk tokens), in packing order."""
    return spy_plans(engine, lambda _, batch: [(len(state.prompt), chunk) for state, chunk in batch.prefill])


@pytest.mark.parametrize("overlap", [False, True])
def test_short_prompts_go_before_a_long_oldest_one_which_still_moves_every_step(model, overlap):
    # a 40-token prompt admitted first, then short prompts arriving one a step: each short one is
    # prefilled whole in one step beside the long one, which takes its quarter chunk (2 of 8) and
    # then what the short ones leave (FIFO would give it the whole budget and make them wait), and
    # moves in every step until it is done
    engine = Engine(model, max_seqs=8, capacity=CAPACITY, max_step_tokens=16, prefill_chunk=8, prefill_budget=8,
                    width_buckets=tuple(range(1, 17)), overlap=overlap)  # fmt: skip
    assert engine.scheduler.head_share == 2
    chunks = record_chunks(engine)
    rng = random.Random(5)
    schedule = [(0, Request(random_prompt(rng, 40, 40), greedy(2)))]
    schedule += [(1 + i, Request(random_prompt(rng, 3 + i % 3, 3 + i % 3), greedy(3))) for i in range(8)]
    assert_oracle(model, engine, schedule)
    long_steps = [step for step in chunks if any(length == 40 for length, _ in step)]
    assert all(step[0][0] == 40 for step in long_steps)  # the oldest packs first
    with_short = [step for step in long_steps if len(step) > 1]
    # the short ones that arrive while it prefills (steps 1-5), each whole in the step it arrives
    assert [step[1:] for step in with_short] == [[(n, n)] for n in (3, 4, 5, 3, 4)]
    assert with_short == chunks[1:6]
    budgets = [8 if i else 16 for i in range(len(with_short))]  # nothing runs before the first step
    assert [step[0][1] for step in with_short] == [
        min(8, budget - sum(c for _, c in step[1:])) for step, budget in zip(with_short, budgets, strict=True)
    ]
    assert sum(chunk for step in long_steps for length, chunk in step if length == 40) == 40
    first = next(i for i, step in enumerate(chunks) if step and step[0][0] == 40)
    assert len(long_steps) == len(chunks[first : first + len(long_steps)])  # no step without it until it is done


def test_the_shortest_remaining_prompt_is_packed_first_behind_the_oldest(model):
    engine = Engine(model, max_seqs=8, capacity=CAPACITY, max_step_tokens=16, prefill_chunk=8, prefill_budget=16,
                    width_buckets=tuple(range(1, 17)))  # fmt: skip
    chunks = record_chunks(engine)
    rng = random.Random(6)
    lengths = [20, 12, 3, 7]  # admitted in this order, in one step
    assert_oracle(model, engine, [(0, Request(random_prompt(rng, n, n), greedy(2))) for n in lengths])
    # with nothing running the step is the prompts' alone: 16 tokens, the oldest's 2 first, then 3 and 7 whole,
    # then 4 of the 12; the oldest takes nothing more (the budget is spent)
    assert chunks[0] == [(20, 2), (3, 3), (7, 7), (12, 4)]
