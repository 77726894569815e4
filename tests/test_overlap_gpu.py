"""Overlap on the H200: replayed graphs with step N+1 queued behind step N decode what eager decodes
without overlap, capture nothing more, never block the host except on the token read, and a store
sized to the device stays inside its memory budget."""

from __future__ import annotations

import random

import pytest
import torch

from batchkv.executor import Engine, Request, SamplingParams
from tests.executor_helpers import drive, random_prompt
from tests.toy_model import ToyModel

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model():
    """fp32: a stop seen one step late changes which rows share a step, and in bf16 cuBLAS's sums
    follow the row count, so a greedy near tie could break differently between the two runs."""
    return ToyModel(vocab=512, hidden=256, heads=8, kv_heads=2, head_dim=64, window=32,
                    dtype=torch.float32, device="cuda", seed=0)  # fmt: skip


def engine(model, use_graphs, overlap, **kwargs) -> Engine:
    opts = {"max_seqs": 8, "capacity": 320, "max_step_tokens": 64, "prefill_chunk": 32, "device": "cuda"}
    return Engine(model, use_graphs=use_graphs, overlap=overlap, **(opts | kwargs))


def schedule_for(seed: int, *, stops: bool) -> list[tuple[int, Request]]:
    rng = random.Random(seed)
    schedule = []
    for i in range(24):
        params = SamplingParams(
            max_new_tokens=rng.randint(1, 60), temperature=rng.choice([0.0, 0.0, 0.8]), top_k=rng.choice([0, 20]),
            seed=i, n=rng.choice([1, 1, 2, 3]), stop_token_ids=(rng.randrange(512),) if stops else (),
        )  # fmt: skip
        schedule.append((rng.randint(0, 40), Request(random_prompt(rng, 1, 100, vocab=512), params)))
    schedule.append((30, Request(random_prompt(rng, 150, 150, vocab=512), SamplingParams(max_new_tokens=100))))
    return schedule


def arrived_by(schedule: list[tuple[int, Request]], step: int, count: int) -> list[int]:
    """The first `count` requests (schedule indexes) that have arrived by `step`."""
    return sorted((i for i, (arrival, _) in enumerate(schedule) if arrival <= step), key=lambda i: schedule[i][0])[
        :count
    ]


@pytest.mark.parametrize("seed", [0, 1])
def test_graphs_with_overlap_decode_what_eager_decodes_without_it(model, seed):
    """Every request's tokens are the same, except that a cancel may land while a cancelled
    request's last token is still in flight: overlap then drops that one token (design notes)."""
    schedule = schedule_for(seed, stops=True)
    cancels = {12: arrived_by(schedule, 12, 2), 25: arrived_by(schedule, 25, 3)[2:]}
    cancelled = {i for indexes in cancels.values() for i in indexes}
    rows = {"row_buckets": (64, 128), "row_step": 64}  # storage grows mid-run, with a step in flight
    expected, eager_ids = drive(engine(model, False, False, **rows), schedule, cancels)
    fast = engine(model, True, True, **rows)
    got, ids = drive(fast, schedule, cancels)
    assert fast.uses_graphs and fast.overlap and fast.metrics.growths >= 2
    for index in range(len(schedule)):
        want, have = expected[eager_ids[index]], got[ids[index]]
        if index not in cancelled:
            assert have == want, f"request {index}"
            continue
        for mine, theirs in zip(have.tokens, want.tokens, strict=True):
            assert theirs[: len(mine)] == mine and len(theirs) - len(mine) <= 1, f"cancelled request {index}"
    fast.assert_idle()


def test_overlap_captures_no_graph_beyond_the_width_buckets(model):
    schedule = schedule_for(2, stops=False)  # no stops: both modes plan the same steps
    engines = {overlap: engine(model, True, overlap) for overlap in (False, True)}
    for e in engines.values():
        drive(e, schedule)
        e.assert_idle()
    plain, fast = (engines[False].metrics, engines[True].metrics)
    assert fast.captures == plain.captures and fast.widths == plain.widths
    assert fast.captures <= 2 * len(fast.widths) * (1 + fast.growths)  # 2: a width's short steps key apart


def test_an_overlapped_step_never_blocks_the_host_but_on_the_token_read(model):
    schedule = schedule_for(3, stops=True)
    served = engine(model, True, True, capacity=320)
    drive(served, schedule)  # captures every width this schedule uses; the store has grown to what it needs
    captures = served.metrics.captures
    torch.cuda.set_sync_debug_mode("error")  # any synchronising CUDA call raises (event waits do not)
    try:
        drive(served, schedule)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert served.metrics.captures == captures
    served.assert_idle()


def test_a_store_sized_to_the_device_stays_inside_its_budget(model):
    torch.cuda.empty_cache()
    sized = Engine(model, max_seqs="auto", memory_fraction=0.5, capacity=4096, max_step_tokens=64,
                   prefill_chunk=32, device="cuda")  # fmt: skip
    s = sized.sizing
    assert sized.cache.max_seqs == s.max_seqs == 64 and s.positions >= 4096  # auto: at most the step budget
    assert sized.cache.pool_rows == s.positions + sized.cache.config.scratch_rows
    assert sized.cache.nbytes == s.store_bytes
    drive(sized, schedule_for(4, stops=False))
    free, total = torch.cuda.mem_get_info()
    assert total - free <= s.budget, (total - free, s)
    sized.assert_idle()
