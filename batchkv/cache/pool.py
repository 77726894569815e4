"""Row allocation in a pool: which rows of a layer group's planes each sequence owns.

Host bookkeeping only (no tensors). A pool of `size` rows is cut into *extents*, runs of
consecutive rows, one per sequence (and one for the scratch rows); the rest are *holes*. An
extent is placed best-fit (the smallest hole that holds it, lowest address among equals), grows
in place when the hole right after it is large enough, and returns its rows to the holes when
freed, merging with its neighbours. When no hole is large enough but the free rows together are,
`compaction` says how to slide every extent down so that the free rows form one hole at the top
(and `opening`, how to then shift the extents above one up so that it can grow in place): the
store moves the rows, then `apply` records the new bases.

Why extents rather than pages: the attention kernels read a sequence's keys as one contiguous run
of rows with no block table, so a sequence must own consecutive rows. Admission knows a request's
reach (prompt + max_new_tokens), so most extents are placed once at their full height and never
move; compaction is for the occasional long request that finds the free rows scattered.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Move:
    """Rows [src, src + rows) of an extent go to [dst, dst + rows)."""

    key: object
    src: int
    dst: int
    rows: int


class RowPool:
    """Extents of a pool of `size` rows, keyed by any hashable (sequence ids, "scratch").

    `slots` > 0 also mirrors the extents of the integer keys in [0, slots) (the sequence ids) in
    two arrays indexed by key, `bases` and `sizes` (0 where a key holds none), kept in step with
    every change, so a step reads its sequences' extents with one gather instead of a lookup each.
    """

    def __init__(self, size: int, slots: int = 0) -> None:
        self.size = size
        self.extents: dict[object, tuple[int, int]] = {}  # key -> (base, rows)
        self._holes: list[tuple[int, int]] = [(0, size)] if size else []  # (base, rows), ascending base
        self.slots = slots
        self.bases = np.zeros(slots, dtype=np.int64)  # base row of sequence id i's extent
        self.sizes = np.zeros(slots, dtype=np.int64)  # its rows (0: it holds none)
        self._used = 0

    def _set(self, key: object, base: int, rows: int) -> None:
        old = self.extents.get(key)
        self._used += rows - (old[1] if old is not None else 0)
        self.extents[key] = (base, rows)
        if type(key) is int and 0 <= key < self.slots:
            self.bases[key], self.sizes[key] = base, rows

    def _pop(self, key: object) -> tuple[int, int]:
        base, rows = self.extents.pop(key)
        self._used -= rows
        if type(key) is int and 0 <= key < self.slots:
            self.bases[key] = self.sizes[key] = 0
        return base, rows

    # ---- queries ------------------------------------------------------------------------------
    @property
    def used(self) -> int:
        """Rows held by extents."""
        return self._used

    @property
    def free(self) -> int:
        return self.size - self.used

    def base(self, key: object) -> int:
        return self.extents[key][0]

    def rows(self, key: object) -> int:
        return self.extents[key][1]

    # ---- changes ------------------------------------------------------------------------------
    def place(self, key: object, rows: int) -> int | None:
        """Give `key` an extent of `rows` rows in the best-fitting hole; its base, or None when no
        hole is large enough (compact, or grow the pool, first). `key` must not hold one."""
        assert key not in self.extents and rows > 0
        best = None
        for i, (_, size) in enumerate(self._holes):
            if size >= rows and (best is None or size < self._holes[best][1]):
                best = i
        if best is None:
            return None
        base, size = self._holes[best]
        if size == rows:
            del self._holes[best]
        else:
            self._holes[best] = (base + rows, size - rows)
        self._set(key, base, rows)
        return base

    def extend(self, key: object, rows: int) -> bool:
        """Grow `key`'s extent to `rows` rows in place, from the hole right after it; False (and
        nothing changes) when that hole is missing or too small."""
        base, old = self.extents[key]
        if rows <= old:
            return True
        i = bisect.bisect_left(self._holes, (base + old, 0))
        if i == len(self._holes) or self._holes[i][0] != base + old or self._holes[i][1] < rows - old:
            return False
        hole_base, hole_rows = self._holes[i]
        if hole_rows == rows - old:
            del self._holes[i]
        else:
            self._holes[i] = (hole_base + rows - old, hole_rows - (rows - old))
        self._set(key, base, rows)
        return True

    def release(self, key: object) -> None:
        """Return `key`'s rows to the holes (merged with the holes beside them)."""
        base, rows = self._pop(key)
        self._add_hole(base, rows)

    def rename(self, old: object, new: object) -> None:
        """`new` takes over `old`'s extent (a moved extent's new rows become its own)."""
        base, rows = self._pop(old)
        self._set(new, base, rows)

    def resize(self, size: int) -> None:
        """The pool now has `size` rows (it grew: the rows past the old size are a hole)."""
        assert size >= self.size
        if size > self.size:
            self._add_hole(self.size, size - self.size)
            self.size = size

    def compaction(self) -> list[Move]:
        """Moves that slide every extent down, in base order, so the free rows become one hole at
        the top. Each move's destination lies below its source; applied in order, a move never
        overwrites rows a later move still reads (each destination ends where the extents before
        it end). Does not change the pool: call `apply` once the rows have moved."""
        moves, top = [], 0
        for key, (base, rows) in sorted(self.extents.items(), key=lambda item: item[1][0]):
            if base != top:
                moves.append(Move(key, base, top, rows))
            top += rows
        return moves

    def opening(self, key: object, rows: int) -> list[Move]:
        """Moves that shift every extent above `key` up by `rows`, so that `key` can `extend` by
        that much, highest first (so a move never overwrites rows a later one reads). Needs the
        free rows in one hole at the top, at least `rows` of them (after `compaction`)."""
        base = self.extents[key][0]
        assert len(self._holes) == 1 and self._holes[0][0] + self._holes[0][1] == self.size
        assert self._holes[0][1] >= rows
        above = sorted(((b, r, k) for k, (b, r) in self.extents.items() if b > base), reverse=True)
        return [Move(k, b, b + rows, r) for b, r, k in above]

    def apply(self, moves: list[Move]) -> None:
        """Record that `moves` (from `compaction` or `opening`) were carried out."""
        for move in moves:
            self._set(move.key, move.dst, move.rows)
        self._holes, top = [], 0
        for base, rows in sorted(self.extents.values()):
            if base > top:
                self._holes.append((top, base - top))
            top = base + rows
        if top < self.size:
            self._holes.append((top, self.size - top))

    def _add_hole(self, base: int, rows: int) -> None:
        i = bisect.bisect_left(self._holes, (base, 0))
        if i < len(self._holes) and self._holes[i][0] == base + rows:  # merge with the hole after
            rows += self._holes.pop(i)[1]
        if i and self._holes[i - 1][0] + self._holes[i - 1][1] == base:  # and the one before
            base, before = self._holes.pop(i - 1)
            rows += before
            i -= 1
        self._holes.insert(i, (base, rows))
