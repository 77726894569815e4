"""Shared drivers for the executor tests: replay a schedule with arrivals and cancellations, and
compute what each request must produce by decoding it alone with the toy model's eager oracle."""

from __future__ import annotations

import random
import sys
from collections.abc import Callable, Iterator
from functools import cache

import pytest

from batchkv.executor import Engine, Output, Request, SamplingParams, gather
from tests.toy_model import ToyModel, reference_generate

MAX_STEPS = 2000  # far more than any test's schedule takes: past it the engine has stalled


def working(engine, limit: int = MAX_STEPS) -> Iterator[int]:
    """0, 1, ... while `engine.has_work`; fails the test after `limit` steps instead of hanging."""
    for step in range(limit):
        if not engine.has_work:
            return
        yield step
    pytest.fail(f"the engine still has work after {limit} steps: nothing finishes (a stalled scheduler?)")


def drive(
    engine: Engine,
    schedule: list[tuple[int, Request]],
    cancels: dict[int, list[int]] | None = None,
    on_step=None,
    max_steps: int = MAX_STEPS,
) -> tuple[dict[int, Output], list[int]]:
    """Submit schedule[i] = (arrival step, request) at its step; cancel cancels[step] (schedule
    indexes) before that step; step until done, failing the test after `max_steps` steps. Returns
    outputs by request id and the ids."""
    cancels = cancels or {}
    order = sorted(range(len(schedule)), key=lambda i: schedule[i][0])
    ids: list[int] = [-1] * len(schedule)
    events, step, cursor = [], 0, 0
    while cursor < len(order) or engine.has_work or any(s >= step for s in cancels):
        if step == max_steps:
            pytest.fail(
                f"drive: {max_steps} steps and not done: live requests {sorted(engine.scheduler.live)}, "
                f"{engine.num_waiting} waiting, {len(order) - cursor} not yet submitted"
            )
        while cursor < len(order) and schedule[order[cursor]][0] <= step:
            ids[order[cursor]] = engine.submit(schedule[order[cursor]][1])
            cursor += 1
        for index in cancels.get(step, []):
            assert ids[index] >= 0, f"cancel of request {index} at step {step}, before it arrives"
            engine.cancel(ids[index])
            if on_step is not None:
                on_step("cancel", ids[index])
        events += engine.step()
        if on_step is not None:
            on_step("step", step)
        step += 1
    return gather(events, {ids[i]: schedule[i][1].params.n for i in range(len(schedule)) if ids[i] >= 0}), ids


def oracle(model: ToyModel, request: Request, capacity: int) -> tuple[list[int], str]:
    """Greedy tokens and finish reason of `request` decoded alone, recomputing the whole prefix."""
    return _oracle(model, request.prompt_ids, request.params.max_new_tokens, request.params.stop_token_ids,
                   capacity, request.rope_offset)  # fmt: skip


@cache
def _oracle(model, prompt, max_new, stops, capacity, offset):
    return reference_generate(model, list(prompt), max_new, stop_token_ids=stops, capacity=capacity, rope_offset=offset)


def random_prompt(rng: random.Random, lo: int, hi: int, vocab: int = 97) -> list[int]:
    return [rng.randrange(vocab) for _ in range(rng.randint(lo, hi))]


def greedy(max_new_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, **kwargs)


def package_calls(fn: Callable[[], object]) -> tuple[object, int]:
    """`fn()` and how many of the package's Python functions it entered (counted by `sys.setprofile`)."""
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        if event == "call" and "batchkv" in frame.f_code.co_filename:
            calls += 1

    sys.setprofile(count)
    try:
        result = fn()
    finally:
        sys.setprofile(None)
    return result, calls
