"""An extent taller than `MOVE_CHUNK` that slides by less than its own height (its old and new rows
overlap) is copied chunk by chunk from the end it leaves first: after a compaction (down) or an
opening (up) every row it held reads back bit for bit, and so do its neighbours'."""

from __future__ import annotations

from dataclasses import replace

import torch

from batchkv import CacheConfig
from batchkv.cache.store import MOVE_CHUNK, ColumnStore

TALL = MOVE_CHUNK + 904  # 5,000 rows: two chunks
SHIFT = 200  # less than a chunk and than the extent's height: old and new rows overlap


def store_with(extents: list[tuple[str, int]], spare: int) -> tuple[ColumnStore, dict[str, tuple]]:
    """A one-layer fp32 store holding `extents` (key, rows) placed in order from its first row past
    the scratch rows, then `spare` free rows; every row written with distinct values. Returns the
    store and each key's K/V [rows, 1, 4]."""
    cfg = CacheConfig(num_layers=1, kv_heads=1, head_dim=4, max_seqs=4, capacity=TALL + SHIFT, dtype=torch.float32)
    cfg = replace(cfg, pool_rows=cfg.scratch_rows + sum(rows for _, rows in extents) + spare)
    store = ColumnStore(cfg, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    written = {}
    for key, rows in extents:
        store.place(key, rows)
        k, v = (torch.randn(rows, 1, 4, generator=gen) for _ in range(2))
        store.write_column(key, 0, k, v)
        written[key] = (k, v)
    return store, written


def assert_holds(store: ColumnStore, key: str, kv: tuple[torch.Tensor, torch.Tensor]) -> None:
    k, v = kv
    got_k, got_v = store.read_column(key, 0, k.shape[0])
    assert torch.equal(got_k, k) and torch.equal(got_v, v), f"{key}: rows changed by the move"


def test_a_tall_extent_compacted_down_by_less_than_its_height_keeps_every_row():
    store, written = store_with([("low", SHIFT), ("tall", TALL)], spare=100)
    base = store.base(0, "tall")
    store.release("low")  # holes of 200 (below tall) and 100 (above): neither holds 250 rows
    store.place("new", 250)  # so every extent slides down first
    assert store.base(0, "tall") == base - SHIFT and store.base(0, "new") == base - SHIFT + TALL
    assert_holds(store, "tall", written["tall"])


def test_a_tall_extent_opened_up_by_less_than_its_height_keeps_every_row():
    store, written = store_with([("low", 100), ("tall", TALL)], spare=SHIFT)
    base = store.base(0, "tall")
    store.resize({"low": 100 + SHIFT}, keep={"low": 100})  # no hole of 300: tall moves up by 200
    assert store.base(0, "tall") == base + SHIFT and store.rows(0, "low") == 100 + SHIFT
    assert_holds(store, "tall", written["tall"])
    assert_holds(store, "low", written["low"])
