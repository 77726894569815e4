"""Admission: which waiting requests get columns and rows now (the `Scheduler`'s first half).

Columns: admission takes one column per request and holds back n - 1 more for its forks, so a fork
can never find the store full. Each column is an extent as tall as the request's longest possible
history (its *reach*: prompt + max_new_tokens - 1, at most capacity), placed at admission, so a
request costs memory for what it can reach and storage never grows in the middle of its decode; the
rows of its forks are held back too. A request waits while its n extents do not fit. With the prefix
cache, cached histories are evicted (least recently used first) to make room, and a request starts
after the longest prefix it can reuse.
"""

from __future__ import annotations

from dataclasses import replace
from operator import attrgetter
from typing import TYPE_CHECKING

from batchkv.executor.prefix import NO_MATCH

if TYPE_CHECKING:
    from collections import deque

    import numpy as np

    from batchkv.cache import BatchedSequenceCache
    from batchkv.executor.prefix import NoPrefixCache, PrefixCache
    from batchkv.executor.state import RequestState

PRIORITY = attrgetter("request.priority")


class Admission:
    """The admission half of `batchkv.executor.scheduler.Scheduler` (which holds the state)."""

    cache: BatchedSequenceCache
    prefix: PrefixCache | NoPrefixCache
    waiting: deque[RequestState]
    prefilling: list[RequestState]
    forking: list[RequestState]  # the prefilling requests still holding columns and rows for forks
    _running: np.ndarray

    @property
    def spare(self) -> int:
        """Columns held back for the forks of prompts in flight (only n > 1 requests hold any)."""
        return sum(r.spare for r in self.forking)

    def free_columns(self) -> int:
        return self.cache.max_seqs - self.cache.num_sequences - self.spare

    def free_rows(self) -> int:
        """Rows the store can still give, less those held back for the forks of prompts in flight."""
        return self.cache.free_rows - sum(r.spare * self.horizon(r) for r in self.forking)

    def horizon(self, state: RequestState) -> int:
        """Positions one of a request's samples can hold: its prompt and every generated token but
        the last, which is never written."""
        return min(self.cache.capacity, len(state.prompt) + state.request.params.max_new_tokens - 1)

    def admit(self) -> None:
        """Give columns to waiting requests, oldest first, while their n columns and the rows of
        their n extents are free (evicting cached prefixes first). With the prefix cache a request
        starts after the longest prefix it can reuse, and one that shares more with a prompt still
        being written waits for it while the requests behind it go on."""
        for state in list(self.waiting):  # queued by priority, FIFO within one (`queue`)
            params, reach = state.request.params, self.horizon(state)
            match = self.prefix.lookup(state)
            if match.wait:
                continue
            columns, rows = params.n, params.n * reach
            match = self._make_room(match, columns, rows)
            columns, rows = self.prefix.room(match, columns, rows)
            if self.free_columns() < columns or self.free_rows() < rows:
                return  # FIFO: nothing behind a request that does not fit goes before it (nor less urgent)
            seq = self.prefix.place(match, reach) if match.history is not None else self.cache.seq_new(reach=reach)
            self.waiting.remove(state)
            state.samples[0].seq, state.spare, state.prefilled = seq, params.n - 1, match.length
            state.cached = match.length
            self.prefilling.append(state)
            if state.spare:
                self.forking.append(state)
            self.prefix.add_live(state)

    def queue(self, state: RequestState) -> None:
        """Put a submitted request in `waiting` after every request as or more urgent than it
        (`Request.priority`; FIFO within one), so admission reads the queue in order, unsorted."""
        waiting, level = self.waiting, state.request.priority
        if not waiting or PRIORITY(waiting[-1]) <= level:
            waiting.append(state)  # the common case: one priority
        else:
            waiting.insert(next(i for i, other in enumerate(waiting) if PRIORITY(other) > level), state)

    def _make_room(self, match, columns: int, rows: int):
        """Evict cached histories (least recently used first) until a request of `columns` samples
        and `rows` positions fits beside the history it reuses; when even that is not enough, it
        takes the cached history's column over (better than recomputing the prefix), and when that
        is not enough either while nothing runs that could free rows (the history is taller than
        the request's reach and its forks need the rest), the history goes too and the prompt is
        computed (waiting would never end). Returns the match as it will be used."""
        prefix = self.prefix
        cached = match.history is not None and match.history.live is None
        attempts = [match, replace(match, take=True)] if cached else [match]
        if cached and not self.prefilling and not len(self._running):
            attempts.append(NO_MATCH)
        for attempt in attempts:
            need_cols, need_rows = prefix.room(attempt, columns, rows)
            short_cols, short_rows = need_cols - self.free_columns(), need_rows - self.free_rows()
            if short_cols > 0 or short_rows > 0:
                prefix.evict(max(short_cols, 0), max(short_rows, 0), keep=attempt.history)
            if self.free_columns() >= need_cols and self.free_rows() >= need_rows:
                return attempt
        return attempts[-1] if attempts[-1] is NO_MATCH else match  # (the history may be evicted)
