"""A step's work follows the live sequences, not max_seqs; a max_seqs that cannot fit is refused at once.

Counted, not timed: the elements a step uploads to its buffers, the segment rows the attention
visits, and the einsums the torch reference runs, at max_seqs 16 and 4,096 with the same sequences.
"""

from __future__ import annotations

import pytest
import torch

from batchkv import BatchedSequenceCache, CacheConfig, LayerSpec, cli
from batchkv.cache import footprint
from batchkv.errors import CapacityError
from batchkv.ops.reference import sdpa_varlen_reference

HKV, D = 2, 8


def make(max_seqs: int) -> BatchedSequenceCache:
    layers = (LayerSpec("flat"), LayerSpec("ring", window=4))
    cfg = CacheConfig(num_layers=2, kv_heads=HKV, head_dim=D, max_seqs=max_seqs, capacity=64, max_write=4,
                      max_width=16, layers=layers, dtype=torch.float32)  # fmt: skip
    return BatchedSequenceCache(cfg, "cpu", attention="reference")


def counted_steps(cache: BatchedSequenceCache) -> tuple[list[tuple[int, int]], list[torch.Tensor]]:
    """Three live sequences: a prefill step, then two decode steps. Per step: (elements uploaded,
    segment rows the attention was given); and every layer's output."""
    visited: list[int] = []
    attend = cache._attend

    def counting(q, k, v, seq_info, **kwargs):
        visited.append(seq_info.shape[0])
        return attend(q, k, v, seq_info, **kwargs)

    cache._attend = counting
    seqs = [cache.seq_new(reach=16) for _ in range(3)]
    gen = torch.Generator().manual_seed(0)
    counts, outs = [], []
    for ids in ([seqs[0]] * 4 + [seqs[1]] * 3 + [seqs[2]] * 2, seqs, seqs):
        cache.declare_step(ids)
        cache.prepare_step(len(ids) + 1)  # one padding row
        visited.clear()
        for layer in range(2):
            q, k, v = (torch.randn(len(ids) + 1, HKV, D, generator=gen) for _ in range(3))
            outs.append(cache.update_and_attend(layer, q, k, v))
        counts.append((cache._buffers.uploaded, max(visited)))
        cache.commit_step()
    return counts, outs


def test_a_step_stages_and_attends_the_same_work_at_max_seqs_16_and_4096():
    small, large = counted_steps(make(16)), counted_steps(make(4096))
    assert small[0] == large[0]
    assert [rows for _, rows in small[0]] == [3, 3, 3]  # the step's segments, not 2 * max_seqs rows
    for a, b in zip(small[1], large[1], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_the_reference_attention_visits_only_the_rows_with_queries(monkeypatch):
    rows, store = 4096, torch.randn(64, 1, HKV, D)
    seq_info = torch.zeros(2 * rows, 4, dtype=torch.int32)
    seq_info[[5, 700, 8000]] = torch.tensor([[0, 2, 0, 10], [2, 1, 16, 3], [3, 1, 32, 7]], dtype=torch.int32)
    calls = []
    einsum = torch.einsum
    monkeypatch.setattr(torch, "einsum", lambda *args: calls.append(1) or einsum(*args))
    out = sdpa_varlen_reference(torch.randn(5, HKV, D), store, store, seq_info)
    assert len(calls) == 2 * 3  # two einsums for each of the three segments, none for the 8,189 empty rows
    assert out[4].abs().max() == 0  # a row no segment covers is zero


def test_a_max_seqs_whose_buffers_cannot_fit_is_refused_at_construction_with_the_bytes():
    # 2e9 sequences of one 512 KiB position each: more than any host holds, refused before allocating
    cfg = CacheConfig(num_layers=64, kv_heads=8, head_dim=256, max_seqs=2 * 10**9, capacity=8)
    need = 2 * 10**9 * cfg.bytes_per_position() + sum(BatchedSequenceCache.static_bytes(cfg))
    with pytest.raises(CapacityError, match=f"max_seqs=2000000000 needs {need} bytes .* lower max_seqs"):
        BatchedSequenceCache(cfg, "cpu", attention="reference")


def test_batchkv_run_refuses_max_seqs_of_a_hundred_million_at_once(monkeypatch, capsys):
    monkeypatch.setattr(footprint, "available_host_memory", lambda: 16 * 2**30)  # a 16 GiB host
    argv = ["run", "--device", "cpu", "--max-seqs", "100000000", "--requests", "2"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "CapacityError: max_seqs=100000000 needs" in err and "17179869184 bytes are available" in err


def test_static_bytes_follow_max_seqs_and_the_step_buffers():
    small, large = (CacheConfig(num_layers=1, kv_heads=1, head_dim=8, max_seqs=n, capacity=8) for n in (4, 8))
    (host4, dev4), (host8, dev8) = BatchedSequenceCache.static_bytes(small), BatchedSequenceCache.static_bytes(large)
    # 4 more sequences: 42 bytes each of state, 8 more int32 seq_info rows of 16 bytes (host and device),
    # 4 more tokens of int64 positions and slots (max_width = max_seqs * max_write)
    assert host8 - host4 == 4 * 42 + 8 * 16 + 4 * 2 * 8 and dev8 - dev4 == 8 * 16 + 4 * 2 * 8
