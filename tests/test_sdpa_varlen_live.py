"""sdpa_varlen(live=): the kernels plan over the table's live rows only (as a table_chunk-row table when
they fit, else in the whole table's shape masked at the count) and attend exactly as over the whole
table; under the interpreter on CPU, stores poisoned with NaN.

A captured graph's table is as long as its width allows (a mixed step of 4,352 tokens: 2,048 rows under
max_seqs 1,024) while its step has a few hundred segments; `live` names how many rows lead the table.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from batchkv.cache.batch import BatchedSequenceCache
from batchkv.cache.config import CacheConfig
from batchkv.errors import ContractError
from batchkv.ops import sdpa_varlen_reference
from batchkv.ops.sdpa import launch
from batchkv.ops.sdpa.launch import SdpaConfig, _counters, sdpa_varlen
from tests.test_sdpa_varlen import DEVICE, make_case

CHUNKED = SdpaConfig(table_chunk=16, block_m_long=32)  # tables of more than 16 rows plan over their live rows
WHOLE = dataclasses.replace(CHUNKED, table_chunk=0)  # the whole table in registers, live or not


def mixed(n: int, seed: int = 0) -> list[tuple[int, int, int]]:
    """n segments (q_len, col, kv_end): decodes, verify blocks, an empty one and prompt chunks."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        q_len = (1, 1, 1, 4, 0, 1, 24)[i % 7]
        kv_end = int(torch.randint(q_len, 90, (), generator=gen)) if q_len else 0
        out.append((q_len, i % 6, max(kv_end, q_len)))
    return out


def padded(info: torch.Tensor, rows: int) -> torch.Tensor:
    """The table with empty rows after its own: a graph's table of `rows` rows."""
    table = torch.zeros(rows, 4, dtype=torch.int32, device=info.device)
    table[: info.shape[0]] = info
    return table


def live_count(n: int) -> torch.Tensor:
    return torch.tensor([n], dtype=torch.int32, device=DEVICE)


def attend(q, k, v, info, **kwargs) -> torch.Tensor:
    out = sdpa_varlen(q, k, v, info, rows=100, out=torch.full_like(q, float("nan")), **kwargs)
    assert not _counters(q.device, 0).any()  # every launch leaves its merge counters at zero
    return out


@pytest.mark.parametrize(("segments", "gap", "shuffle"), [(15, 0, False), (16, 0, False), (17, 0, False),
                                                          (35, 2, False), (30, 0, True)])  # fmt: skip
def test_a_chunked_plan_attends_exactly_as_the_whole_table(segments, gap, shuffle):
    # 15-17 segments: a 16-row table part full, full, and one row past it (the whole table's shape, masked
    # at the count); gap 2: rows between segments stay uncovered, so the zeroing tests each row against
    # every live segment, chunk by chunk; shuffle: the table's rows out of token order
    (q, k, v), info = make_case(mixed(segments), rows=100, group=3, kv_heads=2, head_dim=16, gap=gap, pad=3,
                                shuffle=shuffle)  # fmt: skip
    table = padded(info, 80)  # S_POW2 128: past the chunk, so `live` takes the chunked plan
    chunked = attend(q, k, v, table, config=CHUNKED, live=live_count(info.shape[0]))
    whole = attend(q, k, v, table, config=CHUNKED)  # no live count: the whole table in registers
    assert not chunked.isnan().any()
    assert torch.equal(chunked, whole)  # one plan: the same partition of the work, the same sums
    ref = sdpa_varlen_reference(q, k, v, table, rows=100, live=live_count(info.shape[0]))
    torch.testing.assert_close(chunked, ref, atol=2e-5, rtol=1e-4)
    covered = torch.zeros(q.shape[0], dtype=torch.bool)
    for q_start, q_len, _, _ in info.tolist():
        covered[q_start : q_start + q_len] = True
    assert torch.equal(chunked[~covered], torch.zeros_like(chunked[~covered]))  # uncovered rows: exact zeros


def test_rows_past_live_are_never_read():
    (q, k, v), info = make_case(mixed(20), rows=100, group=3, kv_heads=2, head_dim=16, pad=40)
    table = padded(info, 80)
    table[20:40] = torch.tensor([q.shape[0] - 40, 2, 1, 50], dtype=torch.int32)  # rows a kernel must not plan
    table[70] = torch.tensor([0, 30, 0, 60], dtype=torch.int32)  # a long one over every live segment's rows
    got = attend(q, k, v, table, config=CHUNKED, live=live_count(20))
    want = attend(q, k, v, padded(info, 80), config=CHUNKED)
    assert torch.equal(got, want)
    assert torch.equal(got[-40:], torch.zeros_like(got[-40:]))


@pytest.mark.parametrize("n", [0, 1, 48, 5000])
def test_live_counts_at_the_edges(n):
    # 0: no segment, every row zero; 48: the whole table; past the table: clamped to it
    (q, k, v), info = make_case(mixed(20), rows=100, group=3, kv_heads=2, head_dim=16, pad=2)
    table = padded(info, 48)
    got = attend(q, k, v, table, config=CHUNKED, live=live_count(n))
    want = attend(q, k, v, padded(info[: min(n, 20)], 48), config=WHOLE, live=live_count(n))
    assert torch.equal(got, want)


MALFORMED = {
    "int64": lambda: torch.tensor([3], dtype=torch.int64),
    "two": lambda: torch.tensor([[1, 2]], dtype=torch.int32),
    "int": lambda: 3,
    "elsewhere": lambda: torch.tensor([3], dtype=torch.int32, device="meta"),
}


@pytest.mark.parametrize("kind", MALFORMED)
def test_a_malformed_live_count_is_refused_before_anything_runs(kind):
    (q, k, v), info = make_case(mixed(4), rows=100, group=3, kv_heads=2, head_dim=16)
    live = MALFORMED[kind]()
    out = torch.full_like(q, 7.0)
    with pytest.raises(ContractError, match="live"):
        sdpa_varlen(q, k, v, info, rows=100, out=out, live=live)
    assert (out == 7.0).all()


def test_the_reference_refuses_a_segment_past_live():
    (q, k, v), info = make_case(mixed(6), rows=100, group=3, kv_heads=2, head_dim=16)
    with pytest.raises(ContractError, match="live=3"):
        sdpa_varlen_reference(q, k, v, info, rows=100, live=live_count(3))


def test_the_cache_stages_its_segments_as_the_live_count_and_attends_as_the_reference(monkeypatch):
    monkeypatch.setattr(launch, "DEFAULT_CONFIG", CHUNKED)  # the cache's calls (config=None) plan in chunks
    cfg = CacheConfig(num_layers=1, kv_heads=2, head_dim=16, max_seqs=24, capacity=96, max_write=32,
                      dtype=torch.float32)  # fmt: skip
    caches = [BatchedSequenceCache(cfg, DEVICE, attention=name) for name in ("triton", "reference")]
    gen = torch.Generator().manual_seed(1)
    ids = [[c.seq_new() for _ in range(20)] for c in caches]
    steps = [  # (packed sequence indexes, width): prompts, then a mixed step (a chunk beside 19 decodes), decode
        ([i for i in range(20) for _ in range(2)], 48),
        ([0] * 20 + list(range(1, 20)), 48),  # 20 segments: past 16 live rows, the masked whole-table plan
        (list(range(20)), 24),
    ]
    for packed, width in steps:
        q = torch.randn(width, 6, 16, generator=gen).to(DEVICE)
        k, v = torch.randn(2, width, 2, 16, generator=gen).to(DEVICE)
        outs = []
        for cache, seqs in zip(caches, ids, strict=True):
            cache.declare_step([seqs[i] for i in packed])
            cache.prepare_step(width)
            assert int(cache._buffers.live) == cache._buffers.segments == len({*packed})
            outs.append(cache.update_and_attend(0, q, k, v))
            cache.commit_step()
        torch.testing.assert_close(outs[0], outs[1], atol=2e-5, rtol=1e-4)
        assert torch.equal(outs[0][len(packed) :], torch.zeros_like(outs[0][len(packed) :]))
