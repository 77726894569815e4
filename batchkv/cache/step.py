"""Host planning of one step: segments from a declaration, and the static device buffers it fills.

`StepPlan` is pure bookkeeping (no tensors). `StepBuffers` owns the fixed-address device tensors a
captured graph reads (positions, write slots, `seq_info` per layer group) and fills them through
`Staging`: one host-to-device copy per dtype, from pinned memory on CUDA.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from batchkv.cache.staging import Staging
from batchkv.errors import UnknownSequenceError


@dataclass(frozen=True)
class Segment:
    """A run of `q_len` consecutive packed tokens of sequence `seq`, starting at row `q_start`."""

    seq: int
    q_start: int
    q_len: int


@dataclass(frozen=True)
class StepPlan:
    """A validated declaration: one id per packed token, run-length encoded into segments."""

    ids: tuple[int, ...]
    segments: tuple[Segment, ...]
    counts: dict[int, int]  # tokens per sequence in this step

    @classmethod
    def from_ids(cls, seq_ids: Sequence[int]) -> StepPlan:
        array = np.asarray(seq_ids)
        if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
            raise UnknownSequenceError(f"declare_step takes a flat list of integer sequence ids; got {seq_ids!r}")
        ids = tuple(array.tolist())
        segments: list[Segment] = []
        counts: dict[int, int] = {}
        start = 0
        for i in range(1, len(ids) + 1):
            if i == len(ids) or ids[i] != ids[start]:
                segments.append(Segment(ids[start], start, i - start))
                start = i
        for seq in ids:
            counts[seq] = counts.get(seq, 0) + 1
        return cls(ids, tuple(segments), counts)

    @property
    def num_tokens(self) -> int:
        return len(self.ids)

    @property
    def split(self) -> bool:
        """True when some sequence appears in more than one run."""
        return len(self.segments) != len(self.counts)

    def layout(self, lengths: dict[int, int]) -> list[tuple[int, int, int, int]]:
        """(q_start, q_len, seq, kv_end) per segment, given each sequence's length before the step.

        A sequence's second run continues where its first ends, so kv_end is per run: one past
        that run's last position.
        """
        consumed: dict[int, int] = {}
        out = []
        for seg in self.segments:
            base = lengths[seg.seq] + consumed.get(seg.seq, 0)
            consumed[seg.seq] = consumed.get(seg.seq, 0) + seg.q_len
            out.append((seg.q_start, seg.q_len, seg.seq, base + seg.q_len))
        return out


@dataclass(frozen=True)
class Placement:
    """Where a layer group's extents are for one step: the first row and the rows of each segment's
    sequence's extent (aligned with the layout's segments), and the scratch extent's."""

    base: Sequence[int]
    rows: Sequence[int]
    scratch_base: int
    scratch_rows: int


class StepBuffers:
    """Fixed-address device tensors for one step, sized by the config's maxima.

    positions: int64 [max_width]; slots: int64 [groups, max_width] (one row per layer group: its
    pool's rows); seq_info: int32 [groups, max_segments, 4] (a segment's `col` is its extent's
    first row in that group's pool). Only `copy_` ever writes them, so their addresses never
    change and a captured graph stays valid.
    """

    def __init__(self, max_width: int, groups: int, max_segments: int, device: torch.device) -> None:
        self.max_width = max_width
        self._staging = Staging(self.sizes(max_width, groups, max_segments), device)
        i64 = self._staging.device_buffers[torch.int64]  # [positions w | slots groups * w]
        self.seq_info = self._staging.device_buffers[torch.int32].view(groups, max_segments, 4)
        self.positions = i64[:max_width]
        self.slots = i64[max_width:].view(groups, max_width)

    @staticmethod
    def sizes(max_width: int, groups: int, max_segments: int) -> dict[torch.dtype, int]:
        """Elements per dtype of the staged buffers."""
        return {torch.int64: (1 + groups) * max_width, torch.int32: 4 * groups * max_segments}

    def fill(self, layout: list[tuple[int, int, int, int]], placements: Sequence[Placement], width: int) -> None:
        """Fill positions, slots (unplanned tokens -> the scratch rows) and seq_info for one step.

        Only the first `width` tokens are written: a step of width W reads positions[:W] and
        slots[:, :W], so what lies past them may stay from an earlier step. The slot of position p
        in a group is `base + p % rows` of its sequence's extent there; padded token i writes row
        `i % scratch_rows` of the scratch extent.
        """
        staged = self._staging.begin()
        w, host, groups = self.max_width, staged[torch.int64], len(placements)
        info = staged[torch.int32].reshape(groups, -1, 4)
        info[:] = 0
        q_start, q_len, _, kv_end = np.asarray(layout, dtype=np.int64).reshape(-1, 4).T  # [S] each
        seg = np.repeat(np.arange(len(layout)), q_len)  # the segment of each planned token
        first = np.cumsum(q_len) - q_len
        offset = np.arange(seg.size) - first[seg]  # the token's index within its segment
        at = q_start[seg] + offset  # its packed row
        pos = host[:width]
        pos[:] = 0
        pos[at] = kv_end[seg] - q_len[seg] + offset
        slots = host[w : w * (1 + groups)].reshape(groups, w)
        pad = np.arange(width, dtype=np.int64)  # a padded token's index; nothing reads its row
        for g, place in enumerate(placements):
            base, rows = np.asarray(place.base, dtype=np.int64), np.asarray(place.rows, dtype=np.int64)
            info[g, : len(layout)] = np.stack([q_start, q_len, base, kv_end], 1)
            slots[g, :width] = place.scratch_base + pad % max(place.scratch_rows, 1)
            slots[g, at] = base[seg] + pos[at] % rows[seg]
        self._staging.upload()
