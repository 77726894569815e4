"""The scheduler's slot arrays against the per-sample bookkeeping they replaced, on random traces.

`tests/scheduler_model.py` is the previous scheduler (every step walks its samples as Python
objects), kept as the oracle. Both schedulers drive their own tiny cache through the same trace of
submissions (shared prompt prefixes, n > 1, stop ids, priorities, prompt_logprobs), cancellations
and steps, with overlap (a step in flight while the next is planned) or without, with the prefix
cache (adoption rewinds a cached column, clones copy one) or without. After every step both must
have planned the same step, emitted the same events, and hold every sample in the same state.
A second test counts what a steady decode step visits: its Python calls do not grow with the rows
it decodes, with `max_seqs` or with requests waiting.
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchkv import BatchedSequenceCache, CacheConfig
from batchkv.executor.admission import PRIORITY
from batchkv.executor.request import Request, SamplingParams
from batchkv.executor.scheduler import Scheduler
from batchkv.executor.state import RequestState
from tests.executor_helpers import package_calls
from tests.scheduler_model import ModelRequest, ModelScheduler

VOCAB = 12
BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32)
CAPACITY = 40  # prompts of up to 39 tokens: some samples end at capacity


def _cache(max_seqs: int, capacity: int, chunk: int, width: int = BUCKETS[-1]) -> BatchedSequenceCache:
    cfg = CacheConfig(num_layers=1, kv_heads=1, head_dim=4, max_seqs=max_seqs, capacity=capacity, max_write=chunk,
                      dtype=torch.float32, max_width=width)  # fmt: skip
    return BatchedSequenceCache(cfg, "cpu", attention="reference")


class Side:
    """One scheduler over its own cache, stepped as `Engine.step` steps it (without a model: each
    sampling row's token is a function of its request, sample and RoPE t)."""

    def __init__(self, kind: type, make_state: type, *, max_seqs: int, rows: int, prefix: bool, overlap: bool) -> None:
        self.cache = _cache(max_seqs, capacity=CAPACITY, chunk=8)
        self.sched = kind(self.cache, 24, 8, BUCKETS, None, rows, prefix_cache=prefix)
        self.make_state, self.overlap, self.flight = make_state, overlap, None
        self.plans: list[tuple] = []

    def submit(self, rid: int, request: Request) -> None:
        self.sched.add(self.make_state(rid, request, rid, 0.0))

    def step(self, now: float) -> list:
        self.sched.admit()
        batch = self.sched.plan()
        if batch is not None:
            self.plans.append(plan_view(batch))
            width = next(b for b in BUCKETS if b >= max(len(batch.seq_ids), batch.logits_rows))
            self.cache.declare_step(batch.seq_ids)
            self.cache.prepare_step(width)
            self.cache.commit_step()
            self.sched.launched(batch)
        done = batch
        if self.overlap:
            done, self.flight = self.flight, batch
        events = []
        if done is not None:
            runs = [[token(done, i)] for i in range(len(done.rows))]
            events = self.sched.complete(done, runs, now, None)
        return self.sched.take_cancelled() + events


def token(batch, i: int) -> int:
    sample = batch.samples[i]
    return (sample.owner.id * 7 + sample.index * 3 + batch.t_index[batch.rows[i]] * 5) % VOCAB


def plan_view(batch) -> tuple:
    return (
        list(batch.seq_ids), list(batch.input_ids), list(batch.t_index), list(batch.rows), list(batch.token_src),
        batch.decode_tokens, [(s.owner.id, s.index) for s in batch.samples], [(st.id, c) for st, c in batch.prefill],
        [st.id for st in batch.completed], list(batch.score_rows), list(batch.score_tokens), list(batch.logprob_k),
        list(batch.spans),
    )  # fmt: skip


def check_table(side: Side) -> None:
    """The table's columns agree with each running sample's own view of itself."""
    table = side.sched.table
    for sample in side.sched.running:
        slot = sample.slot
        assert table.samples[slot] is sample and table.read[slot] == len(sample.tokens)
        assert not table.done[slot] and table.seq[slot] == sample.seq >= 0
        if sample.tokens:
            assert table.last[slot] == sample.tokens[-1]


request_strategy = st.fixed_dictionaries({
    "base": st.integers(0, 2), "shared": st.integers(0, 34), "tail": st.integers(1, 6),
    "n": st.integers(1, 3), "max_new": st.integers(1, 14), "priority": st.integers(0, 1),
    "stops": st.lists(st.integers(0, VOCAB - 1), max_size=2), "prompt_logprobs": st.booleans(),
    "seed": st.integers(0, 99),
})  # fmt: skip
op_strategy = st.one_of(
    st.tuples(st.just("submit"), st.lists(request_strategy, min_size=1, max_size=4)),  # arriving together
    st.tuples(st.just("step"), st.integers(1, 4)),
    st.tuples(st.just("cancel"), st.integers(0, 99)),
)


def make_request(spec: dict, most: int) -> Request:
    """A request as `Engine.submit` would accept it (n samples need n columns, and sample in one
    step: n at most max_seqs and the logits rows, which the engine sizes min(256, max_seqs))."""
    bases = [[(7 * b + 3 * i + i * i) % VOCAB for i in range(40)] for b in range(3)]
    tail = [(spec["seed"] + 5 * i) % VOCAB for i in range(spec["tail"])]
    prompt = (bases[spec["base"]][: spec["shared"]] + tail)[: CAPACITY - 1]
    scored = 1 if spec["prompt_logprobs"] and spec["seed"] % 4 == 0 else None
    params = SamplingParams(max_new_tokens=spec["max_new"], n=min(spec["n"], most),
                            stop_token_ids=tuple(spec["stops"]), prompt_logprobs=scored)  # fmt: skip
    return Request(prompt, params, priority=spec["priority"])


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(op_strategy, min_size=1, max_size=24),
    max_seqs=st.integers(2, 7),
    rows=st.integers(2, 8),
    prefix=st.booleans(),
    overlap=st.booleans(),
)
def test_slot_arrays_plan_and_record_what_the_per_sample_model_does(ops, max_seqs, rows, prefix, overlap):
    sides = [
        Side(Scheduler, RequestState, max_seqs=max_seqs, rows=rows, prefix=prefix, overlap=overlap),
        Side(ModelScheduler, ModelRequest, max_seqs=max_seqs, rows=rows, prefix=prefix, overlap=overlap),
    ]
    requests: dict[int, dict] = {}
    clock = [0.0]

    def step() -> None:
        clock[0] += 1.0
        got = [side.step(clock[0]) for side in sides]
        assert got[0] == got[1]
        assert sides[0].plans == sides[1].plans
        views = [views_of(side) for side in sides]
        assert views[0] == views[1]
        check_table(sides[0])

    def views_of(side: Side) -> tuple:
        sched = side.sched
        samples = [
            (rid, s.index, s.seq, s.pending, list(s.tokens), s.finish, s.count, s.next_t)
            for rid in sorted(requests)
            for s in requests[rid][id(side)].samples
        ]
        waiting = [st.id for st in sorted(sched.waiting, key=PRIORITY)]  # in admission order
        return (samples, [(s.owner.id, s.index) for s in sched.running], waiting,
                [st.id for st in sched.prefilling], sorted(sched.live), sorted(side.cache.sequences))  # fmt: skip

    for op, arg in ops:
        if op == "submit":
            for spec in arg:
                rid, request = len(requests), make_request(spec, min(max_seqs, rows))
                for side in sides:
                    side.submit(rid, request)
                requests[rid] = {id(side): side.sched.live[rid] for side in sides}
        elif op == "cancel" and requests:
            rid = arg % len(requests)
            assert sides[0].sched.cancel(rid) == sides[1].sched.cancel(rid)
        else:
            for _ in range(arg if op == "step" else 0):
                step()
    for _ in range(1500):  # bounded drain (up to 96 requests of 14 tokens at 2 rows a step): all finish
        if not any(side.sched.has_work or side.flight is not None for side in sides):
            break
        step()
    assert not sides[0].sched.live and not sides[1].sched.live
    assert sides[0].sched.table.held == 0  # every slot freed once nothing names it


# ---- what a step visits --------------------------------------------------------------------------


def _steady_step_calls(decoding: int, max_seqs: int, waiting: int) -> int:
    """Python calls (function frames entered, in batchkv) of one steady decode step: the
    scheduler's admit, plan, launched and complete and the cache's declare, prepare and commit,
    with `decoding` samples decoding and `waiting` requests that cannot be admitted."""
    cache = _cache(max_seqs, capacity=64, chunk=8, width=512)
    sched = Scheduler(cache, 512, 8, (1, 2, 4, 8, 16, 32, 64, 128, 256, 512), None, 256)
    params = SamplingParams(max_new_tokens=40)
    for rid in range(decoding + waiting):
        if rid == decoding:  # the other columns are taken, so the rest stay waiting
            sched.admit()
            for _ in range(cache.max_seqs - decoding):
                cache.seq_new(reach=1)
        sched.add(RequestState(rid, Request([rid % VOCAB, 1, 2], params), rid, 0.0))

    def one_step() -> None:
        sched.admit()
        batch = sched.plan()
        cache.declare_step(batch.seq_ids)
        cache.prepare_step(next(b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512) if b >= len(batch.seq_ids)))
        cache.commit_step()
        sched.launched(batch)
        sched.complete(batch, [[1]] * len(batch.rows), 0.0, None)

    for _ in range(12):  # prefill (trimmed to buckets), then decode steps
        one_step()
    assert len(sched.running) == decoding and len(sched.waiting) == waiting
    return package_calls(one_step)[1]


def test_a_steady_decode_step_makes_the_same_python_calls_whatever_the_rows_max_seqs_or_waiting():
    base = _steady_step_calls(decoding=4, max_seqs=8, waiting=0)
    assert base > 0
    assert _steady_step_calls(decoding=64, max_seqs=64, waiting=0) == base
    assert _steady_step_calls(decoding=4, max_seqs=4096, waiting=0) == base
    waits = _steady_step_calls(decoding=4, max_seqs=8, waiting=5)  # admission looks at the first, which cannot fit
    assert _steady_step_calls(decoding=64, max_seqs=128, waiting=50) == waits
