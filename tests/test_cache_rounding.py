"""Query-weighted key rounding on e4m3 stores: keys on the grid come back as they were, the store
keeps exactly the codes the rounding chose (written, loaded or cloned), reads are in the model's
basis, and the error lands where the queries look least."""

from __future__ import annotations

import pytest
import torch

from batchkv.cache import BatchedSequenceCache, CacheConfig
from batchkv.cache.rounding import KeyRounding
from batchkv.errors import ConfigError
from batchkv.ops.reference import dequantize_fp8, quantize_fp8

E4M3 = torch.float8_e4m3fn
D, HQ, HKV, N, LAYERS = 64, 4, 2, 40, 2


def _moments(seed: int) -> torch.Tensor:
    """E[q q^T] per (layer, KV head) of queries concentrated in a few directions, [L, Hkv, D, D]."""
    gen = torch.Generator().manual_seed(seed)
    basis = torch.linalg.qr(torch.randn(LAYERS, HKV, D, D, generator=gen))[0]
    return basis @ torch.diag_embed(torch.logspace(2, -3, D).expand(LAYERS, HKV, D)) @ basis.transpose(-1, -2)


def _config(rounding: KeyRounding | None, **kw) -> CacheConfig:
    base = {"num_layers": LAYERS, "kv_heads": HKV, "head_dim": D, "max_seqs": 3, "capacity": 64, "max_write": N}
    return CacheConfig(**{**base, "dtype": torch.float32, "kv_dtype": E4M3, "key_rounding": rounding, **kw})


def _keys(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(N, HKV, D, generator=gen)
    k[..., 7] += 9.0  # an outlier channel
    return k


def _write(cache: BatchedSequenceCache, k: torch.Tensor) -> int:
    seq = cache.seq_new()
    cache.declare_step([seq] * N)
    cache.prepare_step(width=N)
    q = torch.randn(N, HQ, D)
    for layer in range(LAYERS):
        cache.update_and_attend(layer, q, k, torch.randn(N, HKV, D))
    cache.commit_step()
    return seq


def test_keys_already_on_the_e4m3_grid_come_back_unchanged():
    rounding = KeyRounding.calibrate(_moments(0))
    k = dequantize_fp8(*quantize_fp8(_keys(1)))  # exactly representable: nothing to round
    assert torch.equal(rounding.round(0, k), k)
    zeros = torch.zeros(3, HKV, D)
    assert torch.equal(rounding.round(1, zeros), zeros)


def test_the_store_keeps_exactly_the_codes_the_rounding_chose():
    rounding = KeyRounding.calibrate(_moments(2))
    cache = BatchedSequenceCache(_config(rounding), "cpu", attention="reference")
    k = _keys(3)
    seq = _write(cache, k)
    for layer in range(LAYERS):
        chosen = rounding.round(layer, k)
        stored = cache.column(seq, layer)
        codes, scales = stored["k"][:N], stored["k_scale"][:N]
        scale = quantize_fp8(k)[1]  # what the write stores for k itself: amax / 448
        assert torch.equal(codes.float(), (chosen / scale[..., None]).to(E4M3).float())  # the codes chosen
        assert torch.allclose(scales, scale, rtol=2**-23, atol=0)  # the scale within an ulp
        assert not torch.equal(codes, quantize_fp8(k)[0])  # not the codes of rounding to nearest
        keys, _ = cache._read_prefix(seq, N)
        assert torch.allclose(keys[layer], chosen, rtol=2**-22, atol=0)  # read back in the model's basis


def test_loaded_and_cloned_histories_hold_the_codes_the_step_write_holds():
    rounding = KeyRounding.calibrate(_moments(4))
    cache = BatchedSequenceCache(_config(rounding), "cpu", attention="reference")
    k = _keys(5)
    seq = _write(cache, k)
    clone = cache.seq_clone(seq)
    loaded = cache.seq_new()
    cache._load_prefix(loaded, [k] * LAYERS, [torch.randn(N, HKV, D)] * LAYERS)
    for layer in range(LAYERS):
        written = cache.column(seq, layer)["k"][:N]
        assert torch.equal(cache.column(clone, layer)["k"][:N].float(), written.float())
        assert torch.equal(cache.column(loaded, layer)["k"][:N].float(), written.float())


def test_rotated_and_rounded_keys_read_back_in_the_models_basis():
    rounding = KeyRounding.calibrate(_moments(6))
    cache = BatchedSequenceCache(_config(rounding, key_rotation=True), "cpu", attention="reference")
    k = _keys(7)
    keys, _ = cache._read_prefix(_write(cache, k), N)
    assert float((keys[0] - k).norm() / k.norm()) < 0.06  # e4m3 rounding, not a rotation (~140% off)


def test_the_error_lands_where_the_queries_look_least():
    h = _moments(8)
    rounding = KeyRounding.calibrate(h)
    k = _keys(9)

    def weighted(x):  # E[(q . e)^2] per layer, summed over rows and heads
        e = x - k
        return float(torch.einsum("nhd,hde,nhe->", e, h[0], e))

    assert weighted(rounding.round(0, k)) < 0.5 * weighted(dequantize_fp8(*quantize_fp8(k)))


@pytest.mark.parametrize("kw", [{"kv_dtype": torch.bfloat16}, {"num_layers": 3}, {"head_dim": 32}])
def test_a_rounding_for_another_store_is_refused(kw):
    rounding = KeyRounding.calibrate(_moments(10))
    with pytest.raises(ConfigError):
        _config(rounding, **kw)


def test_factors_that_are_not_a_cholesky_factor_are_refused():
    with pytest.raises(ConfigError):
        KeyRounding(torch.zeros(LAYERS, HKV, D, D))
    with pytest.raises(ConfigError):
        KeyRounding(torch.eye(D).expand(LAYERS, HKV, D, D)[..., :3])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_triton_write_keeps_the_codes_the_rounding_chose_on_the_gpu(dtype):
    rounding = KeyRounding.calibrate(_moments(11))
    k = _keys(12)
    stored = []
    for device in ("cpu", "cuda"):
        cache = BatchedSequenceCache(_config(rounding, dtype=dtype), device)  # cuda: the Triton default
        seq, q, v = cache.seq_new(), torch.randn(N, HQ, D).to(device, dtype), torch.randn(N, HKV, D).to(device, dtype)
        cache.declare_step([seq] * N)
        cache.prepare_step(width=N)
        cache.update_and_attend(0, q, k.to(device, dtype), v)
        cache.commit_step()
        stored.append(cache.column(seq, 0)["k"][:N].float().cpu())
    assert torch.equal(stored[0], stored[1])
