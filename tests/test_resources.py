"""Failed allocations and unreadable files are typed refusals that change nothing."""

from __future__ import annotations

import re
import struct

import msgspec
import pytest
import torch

from batchkv import BatchedSequenceCache, CacheConfig, load_manifest
from batchkv.cache import PagedDecodeCache
from batchkv.errors import CapacityError, CheckpointError, ManifestError
from batchkv.executor import Engine
from batchkv.models import build_model, load_checkpoint, save_checkpoint
from tests.test_refusals import assert_same, snapshot
from tests.toy_model import ToyModel

# What each allocator raises when it cannot serve a request: CUDA's OOM type, and the host
# allocator's RuntimeError (torch on CPU raises no OutOfMemoryError).
FAILURES = {
    "cuda": lambda: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    "cpu": lambda: RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 4096 bytes"),
}
CFG = CacheConfig(
    num_layers=2, kv_heads=2, head_dim=8, max_seqs=2, capacity=64, max_write=4, dtype=torch.float32, buckets=(8, 32, 64)
)


class Flaky:
    """An allocator that fails while `failing` is set."""

    def __init__(self, error) -> None:
        self.error, self.failing = error, False

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        if self.failing:
            raise self.error()
        return torch.empty(*args, **kwargs)


def pool_bytes(cfg: CacheConfig, rows: int) -> int:
    """Bytes of a store whose (flat) layers' pools have `rows` rows."""
    return rows * cfg.num_layers * cfg.layer_row_bytes()


@pytest.mark.parametrize("kind", list(FAILURES))
def test_failed_growth_and_reserve_are_capacity_errors_with_the_bytes_and_change_nothing(kind):
    alloc = Flaky(FAILURES[kind])
    cache = BatchedSequenceCache(CFG, "cpu", attention="reference", alloc=alloc)
    assert cache.pool_rows == 32  # 8 scratch rows and one first extent of 8, on the bucket schedule
    a = cache.seq_new()
    cache.declare_step([a] * 4)
    cache.prepare_step(4)
    for layer in range(2):
        cache.update_and_attend(layer, torch.randn(4, 2, 8), torch.randn(4, 2, 8), torch.randn(4, 2, 8))
    cache.commit_step()
    alloc.failing = True
    assert cache.reserve(a, 20) and cache.reach(a) == 20  # in place, from the free rows: nothing to allocate
    # 28 rows held (scratch and a): a's 44 more rows need 72, a new sequence of 40, 68 (past the last bucket)
    for call, rows in ((lambda: cache.reserve(a, 64), 72), (lambda: cache.seq_new(reach=40), 68)):
        before = snapshot(cache)
        with pytest.raises(CapacityError) as info:
            call()
        assert f"allocating {pool_bytes(CFG, rows)} bytes" in str(info.value)
        assert_same(before, snapshot(cache))
        assert cache.sequences == [a] and cache.reach(a) == 20
    for _ in range(4):
        cache.declare_step([a] * 4)
        cache.prepare_step(4)  # within the 20 rows held: no allocation, so it succeeds
        cache.commit_step()
    cache.declare_step([a])
    with pytest.raises(CapacityError, match=f"allocating {pool_bytes(CFG, 64)} bytes"):
        cache.prepare_step(1)  # position 20 needs the next bucket: 12 more rows, 4 free
    alloc.failing = False
    cache.prepare_step(1)
    assert cache.reach(a) == 32 and cache.pool_rows == 64


@pytest.mark.parametrize("kind", list(FAILURES))
def test_a_failed_first_allocation_is_a_capacity_error_for_the_cache_and_the_paged_facade(kind):
    alloc = Flaky(FAILURES[kind])
    alloc.failing = True
    with pytest.raises(CapacityError, match=f"allocating {pool_bytes(CFG, 32)} bytes"):
        BatchedSequenceCache(CFG, "cpu", alloc=alloc)
    with pytest.raises(CapacityError, match="allocating"):
        PagedDecodeCache(2, 2, 16, 8, "cpu", torch.float32, alloc=alloc)


def test_other_runtime_errors_of_an_allocator_are_not_taken_for_out_of_memory():
    def broken(*args, **kwargs):
        raise RuntimeError("a bug, not a full device")

    with pytest.raises(RuntimeError, match="a bug") as info:
        BatchedSequenceCache(CFG, "cpu", alloc=broken)
    assert not isinstance(info.value, CapacityError)


def test_a_store_larger_than_the_host_is_a_capacity_error_naming_its_bytes():
    # 2^48 bytes of K per layer: past any host's address space, so the allocator refuses at once.
    cfg = CacheConfig(num_layers=1, kv_heads=256, head_dim=256, max_seqs=2**14 - 1, capacity=2**20, pool_rows=2**31 - 1)
    with pytest.raises(CapacityError) as info:
        BatchedSequenceCache(cfg, "cpu")
    assert f"allocating {pool_bytes(cfg, 2**31 - 1)} bytes" in str(info.value) and "lower max_seqs" in str(info.value)
    with pytest.raises(CapacityError, match=r"max_seqs=2147483647 needs \d+ bytes .* lower max_seqs"):
        Engine(ToyModel(), max_seqs=2**31 - 1, capacity=256, max_step_tokens=8, prefill_chunk=8)


# ---- checkpoints ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "tiny.safetensors"
    save_checkpoint(build_model("sensenova-u1-tiny", seed=1), path)
    return path


def _broken_files(good: bytes) -> dict[str, bytes]:
    header = struct.unpack("<Q", good[:8])[0]
    return {
        "empty": b"",
        "truncated": good[: len(good) // 2],
        "header only": good[: 8 + header],
        "not safetensors": b"PK\x03\x04 a zip file, not tensors " * 8,
        "absurd header": struct.pack("<Q", 2**62) + good[8:],
    }


def test_an_unreadable_checkpoint_is_a_checkpoint_error_naming_the_file_and_the_model_is_unchanged(
    good_checkpoint, tmp_path
):
    model = build_model("sensenova-u1-tiny", seed=0)
    weights = [p.detach().clone() for p in model.parameters()]
    for name, data in _broken_files(good_checkpoint.read_bytes()).items():
        path = tmp_path / f"{name.replace(' ', '-')}.safetensors"
        path.write_bytes(data)
        with pytest.raises(CheckpointError) as info:
            build_model("sensenova-u1-tiny", checkpoint=path)
        assert str(path) in str(info.value), name
        with pytest.raises(CheckpointError, match=re.escape(str(path))):
            load_checkpoint(model, path)
        assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights, strict=True)), name
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "a.safetensors").write_bytes(good_checkpoint.read_bytes())
    (shards / "b.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match=re.escape(str(shards / "b.safetensors"))):
        build_model("sensenova-u1-tiny", checkpoint=shards)
    loaded = build_model("sensenova-u1-tiny", checkpoint=good_checkpoint)
    assert torch.equal(loaded.lm_head, build_model("sensenova-u1-tiny", seed=1).lm_head)


# ---- manifests -----------------------------------------------------------------------------------
def test_bytes_that_are_not_msgpack_say_so(tmp_path):
    good = load_manifest("manifests/sensenova-u1-8b-sequence.json")
    data = msgspec.msgpack.encode(good)
    json_named_msgpack = tmp_path / "m.msgpack"
    json_named_msgpack.write_bytes(b'{"version": 1}')
    cases = {
        "JSON in a .msgpack file": json_named_msgpack,
        "a byte no msgpack type uses": b"\x81\xc1\xc1",
        "truncated": data[:-5],
        "trailing bytes": data + b"\x00",
    }
    for name, source in cases.items():
        with pytest.raises(ManifestError, match="not valid msgpack") as info:
            load_manifest(source)
        assert info.value.path == "$", name
