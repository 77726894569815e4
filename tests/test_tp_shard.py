"""Shard arithmetic (heads, replicated KV heads, the MLP, padded vocabulary), loading by slices
(each rank reads its share of a checkpoint and no more: the kernel's read counter says so), and
the cache verbs rank 0 mirrors to the other ranks."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import batchkv.models.parallel.slices  # noqa: F401 - imported before any read is counted
from batchkv.cache import BatchedSequenceCache
from batchkv.errors import ConfigError
from batchkv.models import build_model, save_checkpoint
from batchkv.models.parallel import Shard
from batchkv.models.weights import named_weights
from batchkv.tp.roles import MIRRORED
from tests.tp_helpers import save_qwen3


def test_ranks_split_heads_and_replicate_kv_heads_when_there_are_fewer_than_ranks():
    assert Shard(1, 2).heads(32, 8) == (range(16, 32), range(4, 8))
    assert [Shard(r, 16).heads(32, 8)[1] for r in (0, 1, 2, 15)] == [range(0, 1), range(0, 1), range(1, 2), range(7, 8)]
    assert [Shard(r, 4).heads(4, 2) for r in range(4)][3] == (range(3, 4), range(1, 2))  # q head 3 reads kv head 1
    with pytest.raises(ConfigError, match="the ranks must be a multiple of the KV heads"):
        Shard(0, 3).heads(6, 2)
    with pytest.raises(ConfigError, match="query heads is 4, which 3"):
        Shard(0, 3).heads(4, 4)
    with pytest.raises(ConfigError, match="outside"):
        Shard(2, 2)


def test_the_vocabulary_is_split_in_rows_of_ceil_v_over_n_the_last_ranks_padded():
    assert Shard(0, 3).vocab_rows(250) == 84
    assert [Shard(r, 3).vocab(250) for r in range(3)] == [range(0, 84), range(84, 168), range(168, 250)]
    assert Shard(3, 4).vocab(9) == range(9, 9)  # 3 rows each: the last rank holds padding only


def test_one_rank_is_the_whole_model_without_torch_distributed():
    one, table = Shard(), torch.randn(10, 4)
    ids = torch.tensor([3, 0, 9])
    assert torch.equal(one.embed(ids, table), F.embedding(ids, table))
    x = torch.randn(2, 10)
    assert one.gather(x, 10) is x and one.all_reduce(x) is x


def _rchar() -> int:
    return int(re.search(r"rchar: (\d+)", Path("/proc/self/io").read_text()).group(1))


SLACK = 64 * 2**10  # headers and config files


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="needs Linux's per-process read counter")
def test_each_rank_reads_only_its_slices_of_a_sensenova_checkpoint(tmp_path):
    file = tmp_path / "tiny.safetensors"
    save_checkpoint(build_model("sensenova-u1-tiny", "cpu", seed=0), file)
    for rank in (0, 1):
        shard = Shard(rank, 2)
        before = _rchar()
        part = build_model("sensenova-u1-tiny", "cpu", checkpoint=file, shard=shard)
        read = _rchar() - before
        held = sum(p.numel() * p.element_size() for p in part.parameters())
        assert held <= read <= held + SLACK and read < 0.6 * file.stat().st_size, (rank, read, held)
        drawn = build_model("sensenova-u1-tiny", "cpu", seed=0, shard=shard)  # the same slices, drawn
        for (name, a), (_, b) in zip(named_weights(part), named_weights(drawn), strict=True):
            assert torch.equal(a, b), name


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="needs Linux's per-process read counter")
def test_each_rank_reads_only_its_slices_of_a_transformers_checkpoint(tmp_path):
    pytest.importorskip("transformers")
    from batchkv.models.loading import load_hf_shard

    whole = save_qwen3(tmp_path)
    state = whole.state_dict()
    load_hf_shard(tmp_path, Shard(0, 3))  # transformers' own first-use reads happen here, not below
    size = (tmp_path / "model.safetensors").stat().st_size
    for rank in range(3):
        shard = Shard(rank, 3)
        before = _rchar()
        part = load_hf_shard(tmp_path, shard).hf
        read = _rchar() - before
        held = sum(p.numel() * p.element_size() for p in part.parameters())
        padding = 2 * (84 - len(shard.vocab(250))) * 96 * 4  # embedding and head rows past the vocabulary
        assert held - padding <= read <= held - padding + SLACK and read < 0.4 * size, (rank, read, held)
        params = part.state_dict()  # the unfused names, as in the checkpoint (hf_fuse keeps them)
        q, inter, rows = slice(64 * rank, 64 * (rank + 1)), slice(64 * rank, 64 * (rank + 1)), shard.vocab(250)
        layer = "model.layers.1."
        assert torch.equal(params[layer + "self_attn.q_proj.weight"], state[layer + "self_attn.q_proj.weight"][q])
        assert torch.equal(params[layer + "self_attn.o_proj.weight"], state[layer + "self_attn.o_proj.weight"][:, q])
        assert torch.equal(params[layer + "mlp.down_proj.weight"], state[layer + "mlp.down_proj.weight"][:, inter])
        embed = params["model.embed_tokens.weight"]
        assert torch.equal(embed[: len(rows)], state["model.embed_tokens.weight"][rows.start : rows.stop])
        assert not embed[len(rows) :].any()


READ_ONLY = {"pos", "can_admit", "fits", "reach", "ring_floor", "column", "planes", "k_store", "v_store",
             "update_and_attend", "_known", "_layer", "_free_column", "_height_arg", "_growth", "_placements",
             "_restage", "_resize", "_read_prefix", "_load_prefix",
             "_hold", "_drop_declaration",  # called only by mirrored verbs (seq_new, seq_clone; seq_rm, declare,
             # commit)
             "_checked", "_decl", "_declare", "_stage",  # called only by mirrored verbs (begin_step, declare_step,
             # prepare_step)
             "_holds", "static_bytes"}  # fmt: skip


def test_every_state_changing_cache_verb_is_mirrored_to_the_other_ranks():
    """A new BatchedSequenceCache method must be classified: mirrored (batchkv.tp.roles.MIRRORED), or
    read-only/internal here (called only by a mirrored verb, or changing nothing)."""
    methods = {n for cls in BatchedSequenceCache.__mro__[:-1] for n, v in vars(cls).items()
               if callable(v) and not n.startswith("__")}  # fmt: skip
    assert methods - READ_ONLY == set(MIRRORED), f"classify {sorted(methods - READ_ONLY - set(MIRRORED))}"


def test_store_sizing_takes_the_fewest_positions_any_rank_fits():
    from batchkv.cache import CacheConfig
    from batchkv.executor.sizing import size_store

    model = build_model("sensenova-u1-tiny", "cpu", seed=0)
    config = CacheConfig(**model.cache_spec(), max_seqs=4, capacity=64, max_write=16, max_width=32)
    alone, _ = size_store(model, config, 0.9, 4)  # every sequence at capacity: 256 positions
    agreed, sizing = size_store(model, config, 0.9, 4, agree=lambda n: n - 100)  # another rank fits 100 fewer
    assert sizing.positions == alone.pool_rows - config.scratch_rows - 100
    assert agreed.pool_rows == alone.pool_rows - 100
