"""The executor tests' drivers fail, and say why, on an engine that never finishes (an admission or
planning bug), instead of hanging the suite."""

from __future__ import annotations

import pytest

from batchkv.executor import Engine, Request
from tests.executor_helpers import drive, greedy, working
from tests.toy_model import ToyModel


def stalled_engine() -> Engine:
    """An engine holding a live request whose scheduler never plans a step."""
    engine = Engine(ToyModel(seed=0), max_seqs=2, capacity=32, max_step_tokens=8, prefill_chunk=8)
    engine.scheduler.plan = lambda: None
    return engine


def test_drive_fails_with_the_live_requests_when_nothing_finishes():
    with pytest.raises(pytest.fail.Exception, match=r"drive: 50 steps and not done: live requests \[0\]"):
        drive(stalled_engine(), [(0, Request([1, 2, 3], greedy(4)))], max_steps=50)


def test_working_fails_after_its_limit_when_the_engine_keeps_work():
    engine = stalled_engine()
    engine.submit(Request([1, 2, 3], greedy(4)))
    steps = []
    with pytest.raises(pytest.fail.Exception, match="still has work after 30 steps"):
        for step in working(engine, limit=30):
            engine.step()
            steps.append(step)
    assert steps == list(range(30))
