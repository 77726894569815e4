"""Refusals that only a GPU can show (run on the H200): a real CUDA out-of-memory, a CUDA index past
the GPUs present, tensors on the wrong device, and `batchkv run --graphs on` end to end."""

from __future__ import annotations

import json

import pytest
import torch

from batchkv import BatchedSequenceCache, CacheConfig
from batchkv.cli import main
from batchkv.errors import CapacityError, ConfigError, ContractError
from tests.test_refusals import assert_same, snapshot

pytestmark = pytest.mark.gpu

# 8 KV heads of 128 in bf16: 4 KiB of K+V per position per layer.
CFG = CacheConfig(
    num_layers=2, kv_heads=8, head_dim=128, max_seqs=64, capacity=1 << 27, max_write=2, dtype=torch.bfloat16
)


def test_a_cuda_index_past_the_gpus_present_is_a_config_error():
    device = f"cuda:{torch.cuda.device_count()}"
    with pytest.raises(ConfigError, match=device):
        BatchedSequenceCache(CFG, device)


def test_a_real_cuda_out_of_memory_is_a_capacity_error_and_the_cache_still_decodes():
    cache = BatchedSequenceCache(CFG, "cuda")
    a = cache.seq_new()
    before = snapshot(cache)
    pool = 1 << 28  # a's 2^27 positions beside the scratch rows: the doubling schedule's next pool
    with pytest.raises(CapacityError, match=f"allocating {pool * 2 * CFG.layer_row_bytes()} bytes"):
        cache.reserve(a, 1 << 27)  # 2 layers x 2^28 rows x 4 KiB: 2 TiB
    assert_same(before, snapshot(cache))
    cache.declare_step([a, a])
    cache.prepare_step(2)
    q, kv = torch.randn(2, 32, 128, device="cuda", dtype=torch.bfloat16), torch.randn(2, 8, 128, device="cuda")
    out = [cache.update_and_attend(layer, q, kv, kv) for layer in range(2)]
    cache.commit_step()
    assert cache.pos(a) == 2 and all(torch.isfinite(o).all() for o in out)


def test_tensors_on_another_device_are_refused_before_anything_is_written():
    cache = BatchedSequenceCache(CacheConfig(1, 2, 64, max_seqs=2, capacity=64, dtype=torch.float16), "cuda")
    a = cache.seq_new()
    cache.declare_step([a])
    cache.prepare_step(1)
    q, kv = torch.randn(1, 4, 64, device="cuda", dtype=torch.float16), torch.randn(1, 2, 64, device="cuda")
    before = snapshot(cache)
    for args in ((q.cpu(), kv, kv), (q, kv, kv.cpu()), (q, kv.cpu(), kv)):
        with pytest.raises(ContractError, match="is on cpu"):
            cache.update_and_attend(0, *args)
        assert_same(before, snapshot(cache))


def test_batchkv_run_with_graphs_on_decodes_and_writes_its_tokens(tmp_path, capsys):
    tokens = tmp_path / "t.jsonl"
    argv = ["run", "--graphs", "on", "--requests", "6", "--output-len", "4:8", "--output", str(tokens)]
    assert main(argv) == 0
    assert "graphs" in capsys.readouterr().out
    lines = [json.loads(line) for line in tokens.read_text().splitlines()]
    assert len(lines) == 6 and all(line["finish_reason"] == "length" for line in lines)
