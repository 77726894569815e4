"""The scheduler's slot table when it grows: the columns of the slots it already had come along.

`SlotTable` starts at 64 slots and doubles; a request takes a slot per sample when it is submitted,
so 70 waiting requests grow it while the first ones run. The per-sample scheduler the table
replaced (`tests/scheduler_model.py`) is the oracle: the same events, finish reasons included.
"""

from __future__ import annotations

from batchkv.executor.request import Request, SamplingParams
from batchkv.executor.scheduler import Scheduler
from batchkv.executor.state import RequestState
from tests.scheduler_model import ModelRequest, ModelScheduler
from tests.test_scheduler_arrays import VOCAB, Side


def test_a_table_grown_past_its_first_size_keeps_the_stop_ids_of_its_first_samples():
    sides = [
        Side(Scheduler, RequestState, max_seqs=4, rows=4, prefix=False, overlap=False),
        Side(ModelScheduler, ModelRequest, max_seqs=4, rows=4, prefix=False, overlap=False),
    ]
    for rid in range(70):  # more samples than the table's first 64 slots, all held at once
        stops = ((rid * 5) % VOCAB, (rid * 5 + 7) % VOCAB)
        request = Request([rid % VOCAB, 3, 1], SamplingParams(max_new_tokens=8, stop_token_ids=stops))
        for side in sides:
            side.submit(rid, request)
    assert sides[0].sched.table.size > 64
    events = [[], []]
    for step in range(400):  # bounded: 70 requests of at most 8 tokens, 4 at a time
        if not sides[0].sched.has_work:
            break
        for side, out in zip(sides, events, strict=True):
            out += side.step(float(step))
    assert not sides[0].sched.live and not sides[1].sched.live
    assert events[0] == events[1]
    reasons = [e.finish_reason for e in events[1] if e.finish_reason is not None and e.request_id < 64]
    assert reasons.count("stop") >= 8 and reasons.count("length") >= 8  # the stops matter, and not for every one
