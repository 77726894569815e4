"""bench/lib/online.py: Poisson arrivals and the wall-clock-driven online run, on a deterministic clock.

The online loop reads `online.time`; the tests give it a fake clock in which sleeping moves time
to the wake-up point and every engine step takes exactly 10 ms, so latencies are exact.
"""

import itertools
from types import SimpleNamespace

import numpy as np
import pytest

from batchkv.executor import Engine
from batchkv.models import build_model
from bench.lib import online

STEP_S = 0.01


@pytest.fixture
def clocked_engine(monkeypatch):
    """A tiny engine whose steps each take STEP_S on a fake clock that `online` reads."""
    clock = SimpleNamespace(now=0.0)
    fake = SimpleNamespace(perf_counter=lambda: clock.now, sleep=lambda s: setattr(clock, "now", clock.now + s))
    monkeypatch.setattr(online, "time", fake)
    engine = Engine(build_model("sensenova-u1-tiny", "cpu", seed=0), max_seqs=2, capacity=64, max_step_tokens=16,
                    prefill_chunk=16)  # fmt: skip
    step = engine.step

    def timed_step():
        clock.now += STEP_S
        return step()

    engine.step = timed_step
    return engine


def test_poisson_arrivals_are_ascending_reproducible_and_at_the_rate():
    times = online.poisson_arrivals(20000, rate=4.0, seed=3)
    assert times == online.poisson_arrivals(20000, rate=4.0, seed=3)
    assert all(b > a for a, b in itertools.pairwise(times)) and times[0] > 0
    gaps = np.diff([0.0, *times])
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)  # exponential gaps of mean 1 / rate
    assert np.median(gaps) == pytest.approx(0.25 * np.log(2), rel=0.05)


def test_time_to_first_token_counts_from_the_arrival_not_the_start(clocked_engine):
    result = online.run_online(clocked_engine, [[1, 2, 3, 4]], [4], arrivals=[0.5])
    # idle until 0.5 s, one prefill step (width 4, a bucket) samples the first token, three decode steps the rest
    assert result["ttft_p50_ms"] == pytest.approx(1e3 * STEP_S)
    assert result["itl_p50_ms"] == pytest.approx(1e3 * STEP_S)
    assert result["tokens"] == 4 and result["wall_s"] == pytest.approx(0.5 + 4 * STEP_S)
    assert result["tokens_per_s"] == pytest.approx(4 / (0.5 + 4 * STEP_S))


def test_a_request_that_queues_behind_full_columns_waits_in_its_time_to_first_token(clocked_engine):
    # max_seqs is 2: the third request, arrived at 0, is admitted when the first two finish
    result = online.run_online(clocked_engine, [[1, 2], [3, 4], [5, 6]], [3, 3, 3], arrivals=[0.0, 0.0, 0.0])
    assert result["requests"] == 3 and result["tokens"] == 9
    assert result["ttft_p50_ms"] == pytest.approx(1e3 * STEP_S)  # the first two: one step
    assert result["ttft_p99_ms"] > 1e3 * 3 * STEP_S  # the third waited for three steps first
    assert set(result) >= {"rate", "requests", "tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms",
                           "itl_p99_ms", "wall_s"}  # fmt: skip


def test_run_online_refuses_mismatched_or_unsorted_inputs(clocked_engine):
    with pytest.raises(ValueError, match="one output length"):
        online.run_online(clocked_engine, [[1]], [1, 2], [0.0])
    with pytest.raises(ValueError, match="ascending"):
        online.run_online(clocked_engine, [[1], [2]], [1, 1], [0.2, 0.1])
