"""A tensor-parallel engine that loses a rank stops cleanly: a rank that raises mid-step, one that
hangs (the collective's timeout), and one that cannot be built each end in a TensorParallelError
or the build's own error on rank 0 within seconds, with no process of the group left behind; and
what tensor parallelism cannot take is refused before any process starts."""

from __future__ import annotations

import functools
import os
import signal
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from batchkv.errors import ConfigError, TensorParallelError
from batchkv.executor import Engine, Request, SamplingParams, SpeculativeConfig
from batchkv.models import build_model
from batchkv.models.dflash import build_drafter
from batchkv.tp.group import Group
from tests.tp_helpers import faulty

ENGINE = {"max_seqs": 2, "capacity": 64, "max_step_tokens": 32, "prefill_chunk": 16}


ROOT_ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}


def children() -> set[int]:
    """Pids of this process's live child processes."""
    return children_of(os.getpid())


def children_of(me: int) -> set[int]:
    """Pids of `me`'s live child processes (from /proc), but multiprocessing's resource tracker
    (started once, with the first spawned process, for the life of its parent)."""
    out = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            command = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == me and fields[0] != "Z" and b"resource_tracker" not in command:
            out.add(int(stat.parent.name))
    return out


def step_until_it_fails(engine: Engine, limit: int = 40) -> None:
    engine.submit(Request(list(range(1, 20)), SamplingParams(max_new_tokens=30)))
    for _ in range(limit):
        engine.step()
    pytest.fail(f"{limit} steps and no failure")


def test_a_rank_that_raises_mid_step_stops_every_rank_and_rank_0_says_which_and_why():
    before = children()
    engine = Engine(functools.partial(faulty, after=3), tensor_parallel=2, **ENGINE)
    procs = list(engine.role.group.procs)
    assert children() - before == {p.pid for p in procs}
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match="rank 1 raised RuntimeError: an injected fault in the forward"):
        step_until_it_fails(engine)  # its 4th forward: a decode step after the prompt's two chunks
    assert time.monotonic() - start < 30
    assert not any(p.is_alive() for p in procs) and children() == before and not dist.is_initialized()
    with pytest.raises(TensorParallelError, match="cannot step again"):
        engine.step()
    engine.close()


def test_a_rank_killed_between_steps_ends_the_engine_with_its_exit_code_and_no_process_left():
    before = children()
    engine = Engine("sensenova-u1-tiny", tensor_parallel=2, **ENGINE)
    engine.submit(Request(list(range(1, 20)), SamplingParams(max_new_tokens=30, ignore_eos=True)))
    for _ in range(3):
        engine.step()
    rank = engine.role.group.procs[0]
    os.kill(rank.pid, signal.SIGKILL)
    rank.join(10.0)
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match="rank 1 exited with code -9"):
        for _ in range(40):  # the next step's first collective (or the watcher) sees it
            engine.step()
    assert time.monotonic() - start < 15
    assert children() == before and not dist.is_initialized()
    with pytest.raises(TensorParallelError, match="cannot step again"):
        engine.step()
    engine.close()


def test_a_rank_that_hangs_is_ended_by_the_collective_timeout(monkeypatch):
    monkeypatch.setenv("BATCHKV_TP_TIMEOUT", "4")  # the ranks inherit it
    before = children()
    engine = Engine(functools.partial(faulty, after=2, hang=True), tensor_parallel=2, **ENGINE)
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match=r"(?i)timed? ?out"):
        step_until_it_fails(engine)
    assert time.monotonic() - start < 30
    assert children() == before and not dist.is_initialized()  # the hung rank was killed
    engine.close()


def test_a_model_the_ranks_cannot_split_is_refused_and_no_rank_is_left_running():
    before = children()
    with pytest.raises(ConfigError, match="query heads is 4, which 3 tensor-parallel ranks cannot split"):
        Engine("sensenova-u1-tiny", tensor_parallel=3, **ENGINE)
    assert children() == before and not dist.is_initialized()


@pytest.mark.parametrize(
    "model, options, match",
    [
        (build_model("sensenova-u1-tiny", "cpu", seed=0), {}, "not a built SenseNovaLM: each rank builds"),
        (lambda shard: None, {}, "cannot be pickled"),
        ("no/such/dir", {}, "neither a preset"),
        (
            "sensenova-u1-tiny",
            {"speculative": SpeculativeConfig("dflash", block_size=4, drafter=build_drafter(
                build_model("sensenova-u1-tiny", "cpu", seed=0), num_layers=1, target_layer_ids=(0,)))},
            "a factory",
        ),
    ],
    ids=["a built model", "a lambda", "a missing path", "a built drafter"],
)  # fmt: skip
def test_what_each_rank_could_not_build_is_refused_before_any_process_starts(model, options, match):
    before = children()
    with pytest.raises(ConfigError, match=match):
        Engine(model, tensor_parallel=2, **ENGINE, **options)
    assert children() == before and not dist.is_initialized()


def test_an_engine_refused_after_its_ranks_started_stops_them_at_once():
    before = children()
    with pytest.raises(ConfigError, match="max_step_tokens"):
        Engine("sensenova-u1-tiny", tensor_parallel=2, max_seqs=2, capacity=64, max_step_tokens=0)
    assert children() == before and not dist.is_initialized()  # while pytest still holds the traceback


@pytest.mark.parametrize("world", [0, -1, 65, True, 2.0, "2"])
def test_a_tensor_parallel_size_that_is_not_a_count_of_processes_is_refused(world):
    before = children()
    with pytest.raises(ConfigError, match="Engine tensor_parallel is"):
        Engine("sensenova-u1-tiny", tensor_parallel=world, **ENGINE)
    assert children() == before and not dist.is_initialized()


@pytest.mark.parametrize("value", ["abc", "-1", "0", "inf", "nan"])
def test_a_bad_collective_timeout_is_refused_before_any_process_starts(monkeypatch, value):
    monkeypatch.setenv("BATCHKV_TP_TIMEOUT", value)
    monkeypatch.setattr(Group, "spawn", lambda *a, **k: pytest.fail("the ranks were started"))
    with pytest.raises(ConfigError, match="BATCHKV_TP_TIMEOUT is"):
        Engine("sensenova-u1-tiny", tensor_parallel=2, **ENGINE)
    assert not dist.is_initialized()


def test_a_second_tensor_parallel_engine_in_one_process_is_refused_and_the_first_serves_on():
    with Engine("sensenova-u1-tiny", tensor_parallel=2, **ENGINE) as first:
        ranks = children()
        with pytest.raises(ConfigError, match=r"torch\.distributed is already initialised"):
            Engine("sensenova-u1-tiny", tensor_parallel=2, **ENGINE)
        assert children() == ranks
        first.submit(Request([5, 6, 7], SamplingParams(max_new_tokens=4, ignore_eos=True)))
        assert len([e for e in first.run_until_done() if e.token is not None]) == 4
