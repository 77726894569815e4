"""Host planning of one step: segments from a declaration, and the static device buffers it fills.

`StepPlan` is pure bookkeeping (no tensors). `StepBuffers` owns the fixed-address device tensors a
captured graph reads (positions, write slots, `seq_info`) and fills them with one host-to-device
copy per dtype, from pinned memory on CUDA.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

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


class StepBuffers:
    """Fixed-address device tensors for one step, sized by the config's maxima.

    positions: int64 [max_width]; slots: int64 [groups, max_width] (one row per distinct layer row
    count); seq_info: int32 [max_segments, 4]. Only `copy_` ever writes them, so their addresses
    never change and a captured graph stays valid across steps.
    """

    def __init__(self, max_width: int, groups: int, max_segments: int, device: torch.device) -> None:
        self.max_width = max_width
        pin = device.type == "cuda"
        self._host_i64 = torch.zeros((1 + groups) * max_width, dtype=torch.int64, pin_memory=pin)
        self._host_i32 = torch.zeros(max_segments, 4, dtype=torch.int32, pin_memory=pin)
        self._dev_i64 = torch.zeros_like(self._host_i64, device=device)
        self.seq_info = torch.zeros_like(self._host_i32, device=device)
        self.positions = self._dev_i64[:max_width]
        self.slots = self._dev_i64[max_width:].view(groups, max_width)
        # The previous step's async copy must finish before the pinned buffer is rewritten.
        self._copied = torch.cuda.Event() if pin else None
        self._device = device

    def fill(
        self,
        layout: list[tuple[int, int, int, int]],
        group_rows: Sequence[int],
        columns: int,
        scratch: int,
    ) -> None:
        """Fill positions, slots (unplanned tokens -> scratch column) and seq_info for one step."""
        if self._copied is not None:
            self._copied.synchronize()
        w = self.max_width
        host = self._host_i64.numpy()
        pos = host[:w]
        cols = np.full(w, scratch, dtype=np.int64)
        pos[:] = 0
        pad_rows = np.arange(w, dtype=np.int64)  # padded tokens spread over scratch rows; nothing reads them
        info = self._host_i32.numpy()
        info[:] = 0
        for s, (q_start, q_len, col, kv_end) in enumerate(layout):
            pos[q_start : q_start + q_len] = np.arange(kv_end - q_len, kv_end)
            cols[q_start : q_start + q_len] = col
            info[s] = (q_start, q_len, col, kv_end)
        real = cols != scratch
        for g, rows in enumerate(group_rows):
            row = np.where(real, pos % rows, pad_rows % rows)
            host[w * (1 + g) : w * (2 + g)] = row * columns + cols
        non_blocking = self._copied is not None
        self._dev_i64.copy_(self._host_i64, non_blocking=non_blocking)
        self.seq_info.copy_(self._host_i32, non_blocking=non_blocking)
        if self._copied is not None:  # on the stream the copies ran on: the cache's device's
            self._copied.record(torch.cuda.current_stream(self._device))
