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
    temperature, top_p  float64; top_k int64; greedy bool; seed uint64: its request's sampling
                    parameters and seed, which the runner stages for its row (the draw of token i
                    is `sampling.uniforms(seed, index, read + pending)`)
    adjusts  bool   its request adjusts sampling (penalties, logit_bias, min_tokens, min_p, a
                    constraint): a step with such a row runs the runner's adjusted path
    samples, tokens object  its `SampleState` (None when free) and that sample's token list

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
    "top_k",
)  # fmt: skip
FLOAT_COLUMNS = ("emit", "submitted", "temperature", "top_p")
BOOL_COLUMNS = ("done", "plain", "greedy", "adjusts")
UINT_COLUMNS = ("seed",)
OBJECT_COLUMNS = ("samples", "tokens")  # not in `row`: a freed sample keeps its own
NUMBER_COLUMNS = (*INT_COLUMNS, *FLOAT_COLUMNS, *BOOL_COLUMNS, *UINT_COLUMNS)


class SlotTable:
    """Columns of per-sample state by slot (see the module docstring); grows by doubling."""

    def __init__(self, size: int = 64) -> None:
        self.size = 0
        self._free: list[int] = []
        self.stops = np.full((0, 1), -1, dtype=np.int64)
        for names, dtype in ((INT_COLUMNS, np.int64), (FLOAT_COLUMNS, np.float64), (BOOL_COLUMNS, bool),
                             (UINT_COLUMNS, np.uint64), (OBJECT_COLUMNS, object)):  # fmt: skip
            for name in names:
                setattr(self, name, np.zeros(0, dtype=dtype))
        self._grow(size)

    def _grow(self, size: int) -> None:
        old = self.size
        for name in (*NUMBER_COLUMNS, *OBJECT_COLUMNS):
            column = getattr(self, name)
            grown = np.zeros(size, dtype=column.dtype)  # object columns: None
            grown[:old] = column
            setattr(self, name, grown)
        stops = np.full((size, self.stops.shape[1]), -1, dtype=np.int64)
        stops[:old] = self.stops
        self.stops = stops
        self.seq[old:] = -1
        self._free += range(size - 1, old - 1, -1)  # popped lowest first
        self.size = size

    @property
    def held(self) -> int:
        """Slots in use."""
        return self.size - len(self._free)

    def take(self, sample: Any, *, t0: int, limit: int, max_new: int, prompt: int, priority: int, request: int,
             submitted: float, stops: tuple[int, ...], plain: bool, params: Any = None,
             seed: int = 0) -> int:  # fmt: skip
        """A slot for `sample` (a new sample of a request just added), its columns set. `params`:
        its request's `SamplingParams` (None: greedy, adjusting nothing), `seed` its request's."""
        if not self._free:
            self._grow(max(2 * self.size, 1))
        slot = self._free.pop()
        self.samples[slot], self.tokens[slot] = sample, sample.tokens
        if params is None:
            self.temperature[slot], self.top_p[slot], self.top_k[slot] = 0.0, 1.0, 0
            self.greedy[slot], self.adjusts[slot] = True, False
        else:
            self.temperature[slot], self.top_p[slot], self.top_k[slot] = params.temperature, params.top_p, params.top_k
            self.greedy[slot], self.adjusts[slot] = params.greedy, params.adjusts_sampling
        self.seed[slot] = seed
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
        self.samples[slot] = self.tokens[slot] = None
        self._free.append(slot)

    def row(self, slot: int) -> dict[str, Any]:
        """The slot's values by column name, as Python numbers (what a freed sample keeps)."""
        out: dict[str, Any] = {
            name: getattr(self, name)[slot].item() for name in (*INT_COLUMNS, *FLOAT_COLUMNS, *UINT_COLUMNS)
        }
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
