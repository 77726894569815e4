"""e4m3 K/V storage in the cache: geometry and bytes, refusals, the oracle through growth, clones,
rewinds and ring wraps, Triton against the reference, the single-sequence facade, and the
quantisation error of attention against bf16 storage on random data."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicCache

from batchkv import BatchedSequenceCache, CacheConfig, LayerSpec
from batchkv.cache import PagedDecodeCache
from batchkv.errors import CapacityError, ConfigError
from batchkv.ops import sdpa_varlen_reference
from batchkv.ops.reference import dequantize_fp8, quantize_fp8
from tests.oracle import Pair
from tests.test_cache import make_pair

FP8 = torch.float8_e4m3fn
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
GEOMETRY = dict(num_layers=2, kv_heads=2, head_dim=16, max_seqs=3, capacity=64, max_write=8)


def test_kv_dtype_defaults_to_dtype_and_then_the_store_is_k_and_v_as_before():
    cfg = CacheConfig(**GEOMETRY, dtype=torch.bfloat16)
    assert cfg.kv_dtype == torch.bfloat16 and not cfg.quantized
    assert cfg == CacheConfig(**GEOMETRY, dtype=torch.bfloat16, kv_dtype=torch.bfloat16)
    cache = BatchedSequenceCache(cfg, "cpu")
    assert set(cache.planes(0)) == {"k", "v"} and cache.k_store(0).dtype == torch.bfloat16
    assert cfg.bytes_per_position() == 2 * 2 * 2 * 16 * 2  # layers x K/V x heads x D x 2 B
    assert cache.nbytes == cache.pool_rows * cfg.bytes_per_position()


def test_e4m3_rows_take_half_the_bytes_plus_an_fp32_scale_per_position_and_head():
    cfg = CacheConfig(**GEOMETRY, dtype=torch.bfloat16, kv_dtype=FP8)
    cache = BatchedSequenceCache(cfg, "cpu")
    planes = cache.planes(1)
    assert {name: (tuple(t.shape), t.dtype) for name, t in planes.items()} == {
        "k": ((cache.pool_rows, 1, 2, 16), FP8),
        "v": ((cache.pool_rows, 1, 2, 16), FP8),
        "k_scale": ((cache.pool_rows, 1, 2), torch.float32),
        "v_scale": ((cache.pool_rows, 1, 2), torch.float32),
    }
    bf16 = CacheConfig(**GEOMETRY, dtype=torch.bfloat16)
    assert cfg.bytes_per_position() * 2 * 16 == bf16.bytes_per_position() * (16 + 4)  # (D + 4) / (2 D) of bf16
    assert cache.nbytes == cache.pool_rows * cfg.bytes_per_position()


@pytest.mark.parametrize("kv_dtype", [torch.float8_e5m2, torch.int8, torch.float64])
def test_a_storage_dtype_the_kernels_do_not_take_is_refused_at_construction(kv_dtype):
    with pytest.raises(ConfigError, match="float8_e4m3fn"):
        CacheConfig(**GEOMETRY, kv_dtype=kv_dtype)


def test_e4m3_as_the_model_dtype_is_refused_and_triton_refuses_an_odd_head_dim_at_construction():
    with pytest.raises(ConfigError, match=r"CacheConfig\.dtype"):
        CacheConfig(**GEOMETRY, dtype=FP8)
    odd = CacheConfig(**{**GEOMETRY, "head_dim": 24}, kv_dtype=FP8)
    with pytest.raises(ConfigError, match="head_dim 24"):
        BatchedSequenceCache(odd, "cpu", attention="triton")
    assert BatchedSequenceCache(odd, "cpu", attention="reference").config.quantized


@pytest.mark.parametrize(("capability", "refused"), [((8, 0), True), ((8, 6), True), ((8, 9), False), ((9, 0), False)])
def test_the_triton_kernels_refuse_e4m3_storage_on_an_nvidia_gpu_before_sm89(monkeypatch, capability, refused):
    # Triton has no e4m3 tensors below sm_89: an A100 would fail inside the first forward (or capture)
    from batchkv.ops import support

    monkeypatch.setattr(support, "_CAPABILITY", {})  # per-device capability cache
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA A100-SXM4-80GB")
    gpu = torch.device("cuda", 0)
    problem = support.refusal(FP8, 128, "triton", device=gpu)
    assert (problem is not None) == refused
    if refused:
        assert f"compute capability {capability[0]}.{capability[1]}" in problem and "8.9" in problem
    assert support.refusal(torch.bfloat16, 128, "triton", device=gpu) is None
    assert support.refusal(FP8, 128, "reference", device=gpu) is None  # the torch reference stores e4m3 anywhere


def fp8_pair(**kw) -> Pair:
    return make_pair(kv_dtype=FP8, **kw)


def test_e4m3_storage_matches_the_oracle_through_growth_clone_rewind_and_a_ring_wrap():
    # The oracle keeps dequantise(quantise(k)) for every position, exactly what the cache keeps.
    pair = fp8_pair(capacity=256, max_write=3, buckets=(8, 16), tail_step=16)
    a, b = pair.new(), pair.new()
    pair.step([a, a, a, b, b], width=6)
    generation = pair.cache.generation
    for _ in range(4):
        pair.step([a, a, a, b])  # a reaches 15 > 8 rows: growth moves codes and scales; the ring wraps
    assert pair.cache.generation > generation and pair.cache.reach(a) == 16
    c = pair.clone(a, upto=13)  # above the ring floor (15 - 3)
    pair.step([c, a, b])
    pair.rewind(a, 13)
    pair.step([a, a, c, b], width=5)
    pair.step([b, b, b, a], causal=False)  # a draft block reads its own codes both ways


def test_a_failed_growth_of_a_scale_plane_leaves_every_plane_as_it_was():
    calls = {"n": 0, "fail_at": None}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == calls["fail_at"]:
            raise torch.OutOfMemoryError("injected")
        return torch.empty(*args, **kwargs)

    cfg = CacheConfig(**GEOMETRY, dtype=torch.float32, kv_dtype=FP8, buckets=(8, 64))
    pair = Pair(BatchedSequenceCache(cfg, "cpu", attention="reference", alloc=flaky))
    a = pair.new()
    pair.step([a] * 6)
    before = [{name: t.clone() for name, t in pair.cache.planes(i).items()} for i in range(2)]
    calls["n"], calls["fail_at"] = 0, 7  # layer 1's K scales: layer 0 and layer 1's codes are built already
    pair.cache.declare_step([a] * 4)
    with pytest.raises(CapacityError, match="unchanged"):
        pair.cache.prepare_step(4)
    for i, planes in enumerate(before):
        for name, t in pair.cache.planes(i).items():
            assert torch.equal(bits(t), bits(planes[name])), (i, name)
    calls["fail_at"] = None
    pair.naive.rewind(a, 6)
    pair.step([a] * 4)  # the retry grows every plane and attends over the moved codes and scales


def bits(t: torch.Tensor) -> torch.Tensor:
    """e4m3 codes as bytes, fp32 scales as int32 (any strides: scale planes are views of rows-last storage)."""
    return t.view(torch.uint8) if t.dtype == FP8 else t.view(torch.int32)


def resident(cache, layer: int, seq: int) -> dict[str, torch.Tensor]:
    """Every plane's rows of the positions `seq` holds and `layer` keeps, in position order, as bits."""
    planes, n = cache.column(seq, layer), cache.pos(seq)
    rows = planes["k"].shape[0]
    at = torch.arange(max(0, n - rows), n, device=planes["k"].device) % rows
    return {name: bits(plane[at]) for name, plane in planes.items()}


def test_triton_e4m3_cache_matches_reference_e4m3_cache_through_growth_clone_and_rewind():
    cfg = CacheConfig(**GEOMETRY, layers=(LayerSpec(), LayerSpec("ring", window=12)), dtype=torch.float32,
                      kv_dtype=FP8, buckets=(16,), tail_step=16)  # fmt: skip
    caches = [BatchedSequenceCache(cfg, DEVICE, attention=name) for name in ("triton", "reference")]
    for cache in caches:
        assert (cache.seq_new(), cache.seq_new()) == (0, 1)
    gen = torch.Generator().manual_seed(0)
    plan = [  # (packed ids, width, causal), or a verb run on both caches
        ([0] * 8 + [1] * 5, 16, True), ([0] * 8 + [1], 9, True),
        ([1] * 4 + [0], 5, False),  # a draft block; 0 reaches 17 > 16 rows: growth
        ([0] * 4, 4, True),  # 0 passes the ring's 19 rows
        ("clone", 0, 16), ("rewind", 1, 8),  # 2 = a copy of 0's first 16 positions, codes and scales
        ([2] * 8 + [0, 1], 10, True),
    ]  # fmt: skip
    for item in plan:
        if isinstance(item[0], str):
            verb, seq, n = item
            for cache in caches:
                cache.seq_clone(seq, n) if verb == "clone" else cache.rewind(seq, n)
            continue
        packed, width, causal = item
        q = torch.randn(width, 4, 16, generator=gen).to(DEVICE)
        k, v = (torch.randn(2, width, 2, 16, generator=gen) * torch.logspace(-2, 2, 16)).to(DEVICE)
        outs = []
        for cache in caches:
            cache.declare_step(packed)
            cache.prepare_step(width)
            outs.append([cache.update_and_attend(layer, q, k, v, causal=causal) for layer in range(2)])
            cache.commit_step()
        for got, want in zip(*outs, strict=True):
            torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    assert caches[0].generation == caches[1].generation > 1 and caches[0].reach(0) == 32
    assert caches[0].pos(0) > cfg.ring_rows(1)
    for layer in range(2):  # the Triton write stored the reference write's codes and scales, bit for bit
        for seq in (0, 1, 2):
            got, want = (resident(cache, layer, seq) for cache in caches)
            assert all(torch.equal(got[name], want[name]) for name in want), (layer, seq)


def test_the_facade_quantises_a_loaded_prefix_and_hands_back_its_dequantised_values():
    gen = torch.Generator().manual_seed(2)
    source = DynamicCache()
    for layer in range(2):
        k, v = torch.randn(2, 1, 2, 9, 16, generator=gen).to(torch.bfloat16)
        source.update(k, v, layer)
    paged = PagedDecodeCache.from_dynamic_cache(source, 2, "cpu", torch.bfloat16, buckets=(16,), kv_dtype=FP8)
    assert paged.k[0].dtype == FP8 and paged.length == 9
    out = DynamicCache()
    paged.to_dynamic_cache(out)
    for a, b in zip(source.layers, out.layers, strict=True):
        for x, y in ((a.keys, b.keys), (a.values, b.values)):
            assert y.dtype == torch.bfloat16 and y.shape == x.shape
            want = dequantize_fp8(*quantize_fp8(x[0].transpose(0, 1)), torch.bfloat16).transpose(0, 1)[None]
            assert torch.equal(y, want)


def test_attention_over_e4m3_storage_stays_within_5_percent_of_bf16_storage_on_random_data():
    # e4m3 rounds each element by at most 2^-4 of itself (~2.6% RMS); the attention output of N(0, 1)
    # queries, keys and values at scale 1/sqrt(D) stays within 5% (relative Frobenius) of what
    # bf16 storage gives, over long and short histories and every GQA head.
    gen = torch.Generator().manual_seed(3)
    for head_dim, keys in ((128, 1000), (64, 37)):
        q = torch.randn(8, 8, head_dim, generator=gen)
        k, v = torch.randn(2, keys, 1, 2, head_dim, generator=gen)
        info = torch.tensor([[0, 8, 0, keys]], dtype=torch.int32)
        bf16 = sdpa_varlen_reference(q, k.bfloat16(), v.bfloat16(), info)
        (kc, ks), (vc, vs) = quantize_fp8(k), quantize_fp8(v)
        e4m3 = sdpa_varlen_reference(q, kc, vc, info, k_scale=ks, v_scale=vs)
        assert (e4m3 - bf16).norm() <= 0.05 * bf16.norm()


def test_the_facade_on_e4m3_attends_over_what_to_dynamic_cache_hands_back():
    # The attend writes position 9 (quantised); to_dynamic_cache returns all 10 dequantised positions,
    # and SDPA over them is what the attend computed.
    gen = torch.Generator().manual_seed(5)
    source = DynamicCache()
    for layer in range(2):
        k, v = torch.randn(2, 1, 2, 9, 16, generator=gen).to(DEVICE, torch.bfloat16)
        source.update(k, v, layer)
    paged = PagedDecodeCache.from_dynamic_cache(source, 2, DEVICE, torch.bfloat16, buckets=(16,), kv_dtype=FP8)
    paged.set_length(10)
    q, k, v = (torch.randn(1, h, 1, 16, generator=gen).to(DEVICE, torch.bfloat16) for h in (4, 2, 2))
    out = paged.attend(1, q, k, v, 0.25)  # [1, 1, 4, 16]
    back = DynamicCache()
    paged.to_dynamic_cache(back)
    keys, values = back.layers[1].keys.float(), back.layers[1].values.float()  # [1, 2, 10, 16]
    assert keys.shape == (1, 2, 10, 16)
    assert torch.equal(keys[0, :, 9], dequantize_fp8(*quantize_fp8(k[0, :, 0]), torch.bfloat16).float())  # its write
    want = F.scaled_dot_product_attention(q.float(), keys, values, scale=0.25, enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)
