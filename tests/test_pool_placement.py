"""Where `RowPool` puts extents, against a plain-Python model of the pool: one owner per row, the
holes its maximal free runs, an extent placed in the smallest hole that holds it (lowest address
among equal ones). A released extent's rows are a hole again, merged with the holes beside it, and
an extent that moved to grow leaves its old rows as a hole (no compaction needed to reuse them)."""

from __future__ import annotations

import random

import torch

from batchkv import BatchedSequenceCache, CacheConfig
from batchkv.cache.pool import RowPool


class RowModel:
    """The pool as one owner per row: holes are the maximal runs of free rows."""

    def __init__(self, size: int) -> None:
        self.owner: list[object | None] = [None] * size

    def holes(self) -> list[tuple[int, int]]:
        runs, start = [], None
        for row, key in enumerate([*self.owner, "end"]):
            if key is None and start is None:
                start = row
            elif key is not None and start is not None:
                runs.append((start, row - start))
                start = None
        return runs

    def place(self, key: object, rows: int) -> int | None:
        fits = [(size, base) for base, size in self.holes() if size >= rows]
        if not fits:
            return None
        _, base = min(fits)  # the smallest hole; among equal ones, the lowest address
        self.owner[base : base + rows] = [key] * rows
        return base

    def release(self, key: object) -> None:
        self.owner = [None if owner == key else owner for owner in self.owner]


def test_random_places_and_releases_land_where_best_fit_over_maximal_holes_puts_them():
    rng = random.Random(0)
    for trial in range(20):
        size = rng.randint(64, 256)
        pool, model, held = RowPool(size), RowModel(size), []
        for op in range(60):
            if held and rng.random() < 0.45:
                key = held.pop(rng.randrange(len(held)))
                pool.release(key)
                model.release(key)
            else:
                key, rows = (trial, op), rng.choice([1, 4, 8, 8, 16, 16, 24, 32])
                want = model.place(key, rows)
                assert pool.place(key, rows) == want, f"trial {trial} op {op}: {rows} rows, holes {model.holes()}"
                if want is not None:
                    held.append(key)
            assert pool.free == model.owner.count(None)


def test_a_released_extents_rows_are_where_the_next_extent_of_its_size_lands():
    pool = RowPool(256)
    assert [pool.place(key, rows) for key, rows in (("s", 16), ("a", 64), ("b", 32))] == [0, 16, 80]
    pool.release("a")
    assert pool.place("c", 64) == 16  # not 112, past every extent: the rows are reused at once


def test_a_released_extent_merges_with_the_holes_after_and_before_it():
    pool = RowPool(256)
    for key, rows in (("s", 16), ("a", 32), ("b", 64)):
        pool.place(key, rows)
    pool.release("b")  # [112, 256) joins the hole after it
    assert pool.place("c", 240 - 32) == 48
    pool.release("c")
    pool.release("a")  # and [16, 48) the one after it: one hole of 240 rows
    assert pool.place("d", 240) == 16


def test_equal_holes_give_an_extent_the_lowest_address():
    # policy (docs/design.md, "Extents"): best fit, ties to the lowest address, so the top of the
    # pool stays free the longest
    pool = RowPool(256)
    for key in "abcde":
        pool.place(key, 32 if key in "bd" else 16)  # a 0..16, b 16..48, c 48..64, d 64..96, e 96..112
    pool.release("d")
    pool.release("b")
    assert pool.place("f", 32) == 16 and pool.place("g", 32) == 64 and pool.place("h", 32) == 112


def test_an_extent_that_moved_to_grow_leaves_its_old_rows_to_the_next_extent():
    cfg = CacheConfig(num_layers=1, kv_heads=1, head_dim=4, max_seqs=4, capacity=64, dtype=torch.float32,
                      pool_rows=16 + 16 + 16 + 48 + 40)  # fmt: skip
    cache = BatchedSequenceCache(cfg, "cpu", attention="reference")
    store = cache._store
    a, b = cache.seq_new(reach=16), cache.seq_new(reach=16)
    old_a, old_b = store.base(0, a), store.base(0, b)
    assert cache.reserve(a, 48)  # b sits right after a: a moves to new rows to grow
    assert store.base(0, a) == old_b + 16 and store.base(0, b) == old_b  # nothing was compacted
    c = cache.seq_new(reach=16)
    assert store.base(0, c) == old_a  # a's old rows were a hole at once
    assert cache.free_rows == cfg.pool_rows - cfg.scratch_rows - 16 - 48 - 16
