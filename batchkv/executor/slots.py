"""Per-sample state the step reads, as NumPy arrays indexed by slot.

Every sample the scheduler holds (waiting, prefilling, running, or finished while a launched step
still names it) owns one slot of a `SlotTable`. What a steady decode step reads and writes lives
in the table's columns, so `Scheduler.plan`, `launched` and `complete` slice arrays instead of
walking objects (vLLM v1's input batch keeps the same kind of state by request slot):

    seq      int64  its column (-1: none yet, or freed)
    read     int64  tokens read by the host (len(sample.tokens))
    pending  int64  tokens sampled by launched steps, not read yet
    last     int64  the newest read token (what a decode row feeds when none is pending)
    t0       int64  RoPE t of the prompt's last token: the newest token's t is t0 + read + pending
    limit    int64  read + pending at which no step may feed it again: min(max_new_tokens,
                    capacity - prompt + 1) (`SampleState.exhausted`)
    max_new  int64  max_new_tokens; prompt: prompt length (finish reasons "length", "capacity")
    src      int64  its sampling row in the last launched step (where a pending token is gathered)
    priority int64  the request's priority; request: its id; index: the sample's index
    emit     float64  host time of its newest token (inter-token latency)
    submitted float64  its request's submit time (time to first token)
    done     bool   finished or cancelled (its `finish` is set)
    plain    bool   nothing but plain decode: no constraint and no prompt_logprobs (`complete`'s
                    array path takes its rows)
    stops    int64 [slots, K]  its stop ids, padded with -1 (K grows to the most any sample has)

A slot changes when its sample changes (added, admitted, forked, sampled, read, finished,
cancelled), never by a per-step walk. `SampleState` (the sample's identity: its tokens, its
matcher) reads and writes its own row through properties, so code outside the step path sees
plain attributes. Slots are freed only once no launched step names them (`Scheduler`'s retire).
"""

from __future__ import annotations

from typing import Any

import numpy as np

INT_COLUMNS = (
    "seq", "read", "pending", "last", "t0", "limit", "max_new", "prompt", "src", "priority", "request", "index",
)  # fmt: skip
FLOAT_COLUMNS = ("emit", "submitted")
BOOL_COLUMNS = ("done", "plain")


class SlotTable:
    """Columns of per-sample state by slot (see the module docstring); grows by doubling."""

    def __init__(self, size: int = 64) -> None:
        self.size = 0
        self.samples: list[Any] = []  # the SampleState of each slot (None when free)
        self._free: list[int] = []
        self.stops = np.full((0, 1), -1, dtype=np.int64)
        for name in INT_COLUMNS:
            setattr(self, name, np.zeros(0, dtype=np.int64))
        for name in FLOAT_COLUMNS:
            setattr(self, name, np.zeros(0, dtype=np.float64))
        for name in BOOL_COLUMNS:
            setattr(self, name, np.zeros(0, dtype=bool))
        self._grow(size)

    def _grow(self, size: int) -> None:
        old = self.size
        for name in (*INT_COLUMNS, *FLOAT_COLUMNS, *BOOL_COLUMNS):
            column = getattr(self, name)
            grown = np.zeros(size, dtype=column.dtype)
            grown[:old] = column
            setattr(self, name, grown)
        stops = np.full((size, self.stops.shape[1]), -1, dtype=np.int64)
        stops[:old] = self.stops
        self.stops = stops
        self.seq[old:] = -1
        self.samples += [None] * (size - old)
        self._free += range(size - 1, old - 1, -1)  # popped lowest first
        self.size = size

    @property
    def held(self) -> int:
        """Slots in use."""
        return self.size - len(self._free)

    def take(self, sample: Any, *, t0: int, limit: int, max_new: int, prompt: int, priority: int, request: int,
             submitted: float, stops: tuple[int, ...], plain: bool) -> int:  # fmt: skip
        """A slot for `sample` (a new sample of a request just added), its columns set."""
        if not self._free:
            self._grow(max(2 * self.size, 1))
        slot = self._free.pop()
        self.samples[slot] = sample
        sample.table, sample.slot, sample.detached = self, slot, {}
        for name in ("read", "pending", "last", "src"):
            getattr(self, name)[slot] = 0
        self.seq[slot] = -1
        self.t0[slot], self.limit[slot], self.max_new[slot], self.prompt[slot] = t0, limit, max_new, prompt
        self.priority[slot], self.request[slot], self.index[slot] = priority, request, sample.index
        self.emit[slot], self.submitted[slot] = 0.0, submitted
        self.done[slot], self.plain[slot] = False, plain
        if len(stops) > self.stops.shape[1]:
            wider = np.full((self.size, len(stops)), -1, dtype=np.int64)
            wider[:, : self.stops.shape[1]] = self.stops
            self.stops = wider
        self.stops[slot] = -1
        self.stops[slot, : len(stops)] = stops
        return slot

    def give(self, slot: int) -> None:
        """Free `slot` (its sample keeps its last values, read through `SampleState`)."""
        self.samples[slot] = None
        self._free.append(slot)

    def row(self, slot: int) -> dict[str, Any]:
        """The slot's values by column name, as Python numbers (what a freed sample keeps)."""
        out: dict[str, Any] = {name: getattr(self, name)[slot].item() for name in (*INT_COLUMNS, *FLOAT_COLUMNS)}
        out.update((name, bool(getattr(self, name)[slot])) for name in BOOL_COLUMNS)
        return out


class Column:
    """A `SampleState` attribute stored in its slot's column of the table (or, for a sample with
    no slot: made on its own, or freed, in its `detached` dict)."""

    def __init__(self, column: str, cast: type = int) -> None:
        self.column, self.cast = column, cast

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        slot = obj.slot
        if slot < 0:
            return obj.detached[self.column]
        return self.cast(getattr(obj.table, self.column)[slot])

    def __set__(self, obj: Any, value: Any) -> None:
        slot = obj.slot
        if slot < 0:
            obj.detached[self.column] = value
        else:
            getattr(obj.table, self.column)[slot] = value


DETACHED = {"seq": -1, "pending": 0, "emit": 0.0}  # a sample made outside a scheduler starts with these
