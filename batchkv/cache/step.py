"""Host planning of one step: segments from a declaration, and the static device buffers it fills.

`Declaration` is pure bookkeeping (NumPy arrays, no tensors): what `declare_step` was given, one
sequence id per packed token, run-length encoded into segments with array operations (the cache's
word; the executor's plan of a step, `batchkv.executor.state.StepPlan`, is the layer above it).
`StepBuffers` owns the fixed-address device tensors a captured graph reads (positions, write slots,
`seq_info` per layer group) and fills them through `Staging`: one host-to-device copy per live span,
from pinned memory on CUDA. A fill writes and uploads only what
the step covers (its tokens, its segments, and the segment rows the previous step left to clear),
so its cost follows the step, not `max_seqs` or `max_width`.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from batchkv.cache.staging import Staging
from batchkv.errors import CapacityError, StepError, UnknownSequenceError

HEADER = 4  # int32 elements before the tables: the live count, then padding (table rows load as 16-byte vectors)


@dataclass(frozen=True, eq=False)
class Declaration:
    """A declaration: one id per packed token, run-length encoded into segments (arrays).

    ids [T] (as given: any integer dtype); per segment: seqs [S] (its sequence), q_start [S],
    q_len [S], consumed [S] (tokens of the same sequence in earlier runs of this step); per distinct
    sequence, in order of first appearance: members [U], counts [U] (its tokens in the step).
    """

    ids: np.ndarray
    seqs: np.ndarray
    q_start: np.ndarray
    q_len: np.ndarray
    consumed: np.ndarray
    members: np.ndarray
    counts: np.ndarray

    @classmethod
    def from_ids(cls, seq_ids: Sequence[int]) -> Declaration:
        array = np.asarray(seq_ids)
        if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
            raise UnknownSequenceError(f"declare_step takes a flat list of integer sequence ids; got {seq_ids!r}")
        n = array.size
        if n == 0:
            empty = np.zeros(0, dtype=np.int64)
            return cls(array, empty, empty, empty, empty, empty, empty)
        change = np.empty(n, dtype=bool)
        change[0] = True
        np.not_equal(array[1:], array[:-1], out=change[1:])
        q_start = np.flatnonzero(change)
        q_len = np.empty_like(q_start)
        np.subtract(q_start[1:], q_start[:-1], out=q_len[:-1])
        q_len[-1] = n - q_start[-1]
        seqs = array[q_start]
        ordered = np.sort(seqs)
        if not (ordered[1:] == ordered[:-1]).any():  # every sequence in one run (the common case)
            return cls(array, seqs, q_start, q_len, np.zeros_like(q_len), seqs, q_len)
        # A sequence in several runs: its runs continue one another, in packed order.
        by_seq = np.argsort(seqs, kind="stable")
        sorted_seqs, sorted_len = seqs[by_seq], q_len[by_seq]
        before = np.cumsum(sorted_len) - sorted_len  # tokens of earlier segments in sorted order
        first = np.empty(len(seqs), dtype=bool)
        first[0] = True
        np.not_equal(sorted_seqs[1:], sorted_seqs[:-1], out=first[1:])
        group_start = np.maximum.accumulate(np.where(first, np.arange(len(seqs)), 0))
        consumed = np.empty_like(q_len)
        consumed[by_seq] = before - before[group_start]
        heads = by_seq[first]  # each sequence's first segment (stable sort: its earliest)
        totals = np.add.reduceat(sorted_len, np.flatnonzero(first))
        order = np.argsort(heads, kind="stable")
        return cls(array, seqs, q_start, q_len, consumed, seqs[heads][order], totals[order])

    def refuse_writes(self, lengths: np.ndarray, max_write: int, capacity: int) -> None:
        """CapacityError for the first sequence, in packed order, that writes more than `max_write`
        tokens in the step or ends it past `capacity` positions; `lengths` [U] are the members'."""
        counts, ends = self.counts, lengths + self.counts
        over, beyond = counts > max_write, ends > capacity
        if over.any() or beyond.any():
            i = int(np.argmax(over | beyond))
            seq = self.members[i].item()
            if over[i]:
                raise CapacityError(
                    f"declare_step: sequence {seq} writes {counts[i]} tokens; max_write is {max_write} "
                    "(split its prefill into smaller chunks)"
                )
            raise CapacityError(
                f"sequence {seq} needs {ends[i]} positions; capacity is {capacity} "
                "(raise capacity or finish the sequence)"
            )

    def refuse_width(self, verb: str, width: int, max_width: int) -> None:
        """StepError unless `width` covers the declared tokens and is at most `max_width`."""
        if not self.num_tokens <= width <= max_width:
            raise StepError(
                f"{verb}: width {width} must cover the {self.num_tokens} declared tokens "
                f"and be at most max_width={max_width}"
            )

    @property
    def num_tokens(self) -> int:
        return self.ids.size

    @property
    def num_segments(self) -> int:
        return self.seqs.size

    @property
    def split(self) -> bool:
        """True when some sequence appears in more than one run."""
        return self.seqs.size != self.members.size

    @functools.cached_property
    def longest(self) -> int:
        """The most tokens of any run (computed once: a steady decode step reuses its declaration)."""
        return int(self.q_len.max()) if self.q_len.size else 0

    def kv_end(self, lengths: np.ndarray) -> np.ndarray:
        """One past each segment's last position, given the lengths (by sequence id) before the step:
        a sequence's second run continues where its first ends."""
        return lengths[self.seqs] + self.consumed + self.q_len


@dataclass(frozen=True)
class Placement:
    """Where a layer group's extents are: the first row and the rows of every sequence's extent
    (arrays indexed by sequence id), and the scratch extent's."""

    base: np.ndarray
    rows: np.ndarray
    scratch_base: int
    scratch_rows: int


class StepBuffers:
    """Fixed-address device tensors for one step, sized by the config's maxima.

    positions: int64 [max_width]; slots: int64 [groups, max_width] (one row per layer group: its
    pool's rows); seq_info: int32 [groups, max_segments, 4] (a segment's `col` is its extent's
    first row in that group's pool); live: int32 [1], the step's segments (the attention reads no
    table row past them: `sdpa_varlen(live=)`), staged in the same copy as the first group's table (a
    16-byte header before it). Only `copy_` ever writes them, so their addresses never change and a
    captured graph stays valid. `segments`: the rows of `seq_info` the last fill staged (every row
    past them is zero); `uploaded`: elements the last fill copied.
    """

    def __init__(self, max_width: int, groups: int, max_segments: int, device: torch.device) -> None:
        self.max_width = max_width
        self.max_segments = max_segments
        self._staging = Staging(self.sizes(max_width, groups, max_segments), device)
        i64 = self._staging.device_buffers[torch.int64]  # [positions w | slots groups * w]
        i32 = self._staging.device_buffers[torch.int32]  # [live, 3 unused | seq_info groups * max_segments * 4]
        self.live, self.seq_info = i32[:1], i32[HEADER:].view(groups, max_segments, 4)
        self.positions = i64[:max_width]
        self.slots = i64[max_width:].view(groups, max_width)
        self.segments = 0
        self.uploaded = 0

    @staticmethod
    def sizes(max_width: int, groups: int, max_segments: int) -> dict[torch.dtype, int]:
        """Elements per dtype of the staged buffers."""
        return {torch.int64: (1 + groups) * max_width, torch.int32: HEADER + 4 * groups * max_segments}

    def fill(self, decl: Declaration, kv_end: np.ndarray, placements: Sequence[Placement], width: int) -> None:
        """Fill positions, slots (unplanned tokens -> the scratch rows) and seq_info for one step.

        Only the first `width` tokens are written: a step of width W reads positions[:W] and
        slots[:, :W], so what lies past them may stay from an earlier step. The slot of position p
        in a group is `base + p % rows` of its sequence's extent there; padded token i writes row
        `i % scratch_rows` of the scratch extent. seq_info rows past the step's segments are zero:
        only those the previous fill used are cleared again.
        """
        staged = self._staging.begin()
        w, host, groups = self.max_width, staged[torch.int64], len(placements)
        info = staged[torch.int32][HEADER:].reshape(groups, -1, 4)
        count, tokens, stale = decl.num_segments, decl.num_tokens, self.segments
        staged[torch.int32][0] = count
        if stale > count:
            info[:, count:stale] = 0
        q_start, q_len, seqs = decl.q_start, decl.q_len, decl.seqs
        pos = host[:width]
        # Token i of a segment sits at position kv_end - q_len + i, packed row q_start + i: tokens
        # are packed in segment order from row 0, so a token's position is its row plus its
        # segment's (kv_end - q_len - q_start).
        shift = kv_end - q_len - q_start
        pos[:tokens] = np.arange(tokens) + (shift if count == tokens else np.repeat(shift, q_len))
        pos[tokens:] = 0
        slots = host[w : w * (1 + groups)].reshape(groups, w)
        pad = np.arange(tokens, width, dtype=np.int64)  # a padded token's index; nothing reads its row
        for g, place in enumerate(placements):
            base, rows = place.base[seqs], place.rows[seqs]
            row = info[g, :count]
            row[:, 0], row[:, 1], row[:, 2], row[:, 3] = q_start, q_len, base, kv_end
            if count != tokens:
                base, rows = np.repeat(base, q_len), np.repeat(rows, q_len)
            slots[g, :tokens] = base + pos[:tokens] % rows
            slots[g, tokens:width] = place.scratch_base + pad % max(place.scratch_rows, 1)
        table, used = 4 * self.max_segments, 4 * max(count, stale)  # int32 elements: a group's table, its live rows
        spans = {
            torch.int64: [(0, width)] + [(w * (1 + g), w * (1 + g) + width) for g in range(groups)],
            torch.int32: [(0, HEADER)] + [(HEADER + table * g, HEADER + table * g + used) for g in range(groups)],
        }
        self.uploaded = self._staging.upload(spans)
        self.segments = count
