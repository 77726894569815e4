"""Recording a step's tokens once read: the array path of a plain step and the row-by-row path.

`Scheduler.complete` hands each step here after the prompt logprobs: `record_plain` when every row
read one token and is plain decode (the common step: array work over the rows and events built in
bulk), `record_runs` otherwise (a verify segment's run, a constrained row whose matcher accepts each
token, a prompt's logprobs to hand out). Both leave the `SlotTable` and each `SampleState` as the
other would, and return the step's events and the samples that finished (the scheduler frees them).
"""

from __future__ import annotations

from collections import deque

import numpy as np

from batchkv.executor.constraints import accept
from batchkv.executor.request import Event, events
from batchkv.executor.slots import SlotTable
from batchkv.executor.state import SampleState, StepPlan

REASONS = np.array([None, "stop", "length", "capacity"], dtype=object)  # `record_plain`'s finish codes


def record_plain(
    table: SlotTable, batch: StepPlan, token: np.ndarray, now: float, sampled: list
) -> tuple[list[Event], list[SampleState]]:
    """`Scheduler.complete` for a step whose every row read one token and is plain decode (no constraint,
    no prompt_logprobs: `SlotTable.plain`), as array work over the rows: tokens recorded, stop
    ids, max_new_tokens and capacity (the slots' `limit`, set with the cache's capacity) checked
    together. `token`: each row's, int64. Returns the events and the samples that finished."""
    slots = batch.slots
    table.pending[slots] -= 1
    keep = ~table.done[slots]  # finished or cancelled since launch: the token is discarded
    if not keep.all():
        slots, token = slots[keep], token[keep]
        sampled = [sampled[i] for i in np.flatnonzero(keep).tolist()]
    read = table.read[slots] + 1
    table.read[slots], table.last[slots], table.emit[slots] = read, token, now
    stop = (table.stops[slots] == token[:, None]).any(axis=1)
    # max_new_tokens or capacity reached: `limit` is min(max_new_tokens, capacity - prompt + 1)
    ends = stop | (read >= table.limit[slots])
    values = token.tolist()
    deque(map(list.append, table.tokens[slots].tolist(), values), maxlen=0)  # each its token
    finished: list[SampleState] = []
    reasons: list[str | None] = [None] * len(values)
    if ends.any():  # some sample finished (most steps: none)
        length = read >= table.max_new[slots]  # else capacity: prompt + read > capacity, no position left
        code = np.where(stop, 1, np.where(length, 2, 3))[ends]
        ended = np.flatnonzero(ends)
        finished = table.samples[slots[ended]].tolist()
        for i, sample, reason in zip(ended.tolist(), finished, REASONS[code].tolist(), strict=True):
            sample.finish = reasons[i] = reason
    out = events(table.request[slots].tolist(), values, reasons, table.index[slots].tolist(), sampled)
    return out, finished


def record_runs(
    table: SlotTable, batch: StepPlan, tokens: list[list[int]], now: float, sampled: list, capacity: int
) -> tuple[list[Event], list[SampleState]]:
    """`Scheduler.complete` row by row, for a step with a verify segment's run, a constrained row (its
    matcher accepts each token) or a prompt's logprobs to hand out. Returns the events and the
    samples that finished."""
    events, finished = [], []
    for sample, run, lp in zip(batch.samples, tokens, sampled, strict=True):
        sample.pending -= 1
        if sample.finish is not None:
            continue
        state, params = sample.owner, sample.owner.request.params
        prompt_lps = None
        if params.prompt_logprobs is not None and sample.index == 0 and not sample.tokens:
            prompt_lps, state.prompt_logprobs = tuple(state.prompt_logprobs), []
        for token in run:
            grammar = accept(sample.matcher, token) if sample.matcher is not None else None
            if grammar == "grammar":  # no token could continue it: ends without the token
                sample.finish = "grammar"
                events.append(Event(state.id, None, "grammar", sample.index, None, prompt_lps))
                break
            sample.tokens.append(token)
            sample.last_emit = now
            if token in params.stop_token_ids or grammar == "stop":
                sample.finish = "stop"
            elif len(sample.tokens) >= params.max_new_tokens:
                sample.finish = "length"
            elif len(state.prompt) + len(sample.tokens) > capacity:  # no position left to write it
                sample.finish = "capacity"
            events.append(Event(state.id, token, sample.finish, sample.index, lp, prompt_lps))
            prompt_lps = None
            if sample.finish is not None:
                break
        if sample.tokens:
            table.read[sample.slot], table.last[sample.slot] = len(sample.tokens), sample.tokens[-1]
        if sample.finish is not None:
            finished.append(sample)
    return events, finished
