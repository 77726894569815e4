"""The fake-quantised variants of bench/kv_accuracy.py: an fp32 store handed e4m3 values attends as
an e4m3 store does, bit for bit; centring changes nothing but the rounding; GPTQ-style rounding
stays on the store's grid and errs less where the queries look."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from batchkv.cache import BatchedSequenceCache, CacheConfig
from batchkv.ops.reference import quantize_fp8

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import kv_variants

D, HQ, HKV, N, LAYERS = 64, 6, 2, 24, 2


def _config(kv_dtype: torch.dtype) -> CacheConfig:
    return CacheConfig(num_layers=LAYERS, kv_heads=HKV, head_dim=D, max_seqs=1, capacity=64, max_write=N,
                       dtype=torch.float32, kv_dtype=kv_dtype)  # fmt: skip


def _qkv(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(N, HKV, D, generator=gen)
    k[..., 5] += 15.0  # an outlier channel, as trained keys have
    q = torch.randn(N, HQ, D, generator=gen)
    return q, k, torch.randn(N, HKV, D, generator=gen)


def _run(cache: BatchedSequenceCache, steps: list[tuple]) -> list[torch.Tensor]:
    """Each step's attention output for layer 0, then layer 1, in chunks as scoring feeds them."""
    seq, outs = cache.seq_new(), []
    for q, k, v in steps:
        cache.declare_step([seq] * q.shape[0])
        cache.prepare_step(width=q.shape[0])
        outs += [cache.update_and_attend(layer, q, k, v) for layer in range(LAYERS)]
        cache.commit_step()
    return outs


def _plan(flags: str, calib=None) -> kv_variants.Plan:
    return kv_variants.Plan(set(flags.split("-")) - {""}, LAYERS, D, calib)


def test_an_fp32_store_of_fake_quantised_kv_attends_bit_for_bit_as_an_e4m3_store():
    steps = [_qkv(0), _qkv(1)]
    e4m3 = _run(BatchedSequenceCache(_config(torch.float8_e4m3fn), "cpu", attention="reference"), steps)
    fake = _run(kv_variants.FakeQuantCache(_config(torch.float32), "cpu", _plan("")), steps)
    assert all(torch.equal(a, b) for a, b in zip(e4m3, fake, strict=True))


def test_centring_keys_leaves_attention_unchanged_but_for_rounding():
    steps = [_qkv(2), _qkv(3)]
    plain = _run(kv_variants.FakeQuantCache(_config(torch.float32), "cpu", _plan("bf16")), steps)
    plan = _plan("bf16-centre")
    centred = _run(kv_variants.FakeQuantCache(_config(torch.float32), "cpu", plan), steps)
    assert plan.mu[0] is not None and float(plan.mu[0][:, 5].min()) > 10  # the outlier's mean, from step 1
    for a, b in zip(plain, centred, strict=True):
        assert float((a - b).norm() / a.norm()) < 0.01  # bf16 rounding of different keys only
    assert not torch.equal(plain[-1], centred[-1])


def test_sink_rows_are_kept_in_bf16_and_the_rest_rounded_to_e4m3():
    q, k, v = _qkv(4)
    _, kq, vq = _plan("sink4")(0, 0, q, k, v)
    assert torch.equal(kq[:4], kv_variants.bf16(k[:4])) and torch.equal(vq[:4], kv_variants.bf16(v[:4]))
    assert torch.equal(kq[4:], kv_variants.fake_e4m3(k[4:]))
    _, later, _ = _plan("sink4")(0, 64, q, k, v)  # a later chunk: no sink rows in it
    assert torch.equal(later, kv_variants.fake_e4m3(k))


def test_gptq_rounding_stays_on_the_rows_e4m3_grid_and_errs_less_where_queries_look():
    gen = torch.Generator().manual_seed(5)
    k = torch.randn(256, HKV, D, generator=gen)
    basis = torch.linalg.qr(torch.randn(D, D, generator=gen))[0]
    h = basis @ torch.diag(torch.logspace(2, -2, D)) @ basis.T  # queries concentrated in a few directions
    h = h.expand(HKV, D, D).contiguous()
    out = kv_variants.gptq_round(k, kv_variants._cholesky_inverse_upper(h))
    scale = quantize_fp8(k)[1][..., None]  # the store's per-row scale, amax / 448
    assert torch.equal((out / scale).to(torch.float8_e4m3fn).float() * scale, out)  # codes on that scale

    def weighted(x):  # mean (q . e)^2 over the query distribution
        e = x - k
        return float(torch.einsum("nhd,hde,nhe->", e, h, e))

    assert weighted(out) < 0.5 * weighted(kv_variants.fake_e4m3(k))


def test_scale_search_keeps_one_scale_per_row_and_errs_less_where_queries_look():
    k, gen = _qkv(6)[1], torch.Generator().manual_seed(6)
    h = torch.randn(HKV, D, D, generator=gen)
    h = h @ h.transpose(1, 2)  # a query second moment
    out = kv_variants.search_round(k, h)
    plain = kv_variants.fake_e4m3(k)

    def weighted(x):  # per row (q . e)^2 averaged over the queries
        e = x - k
        return torch.einsum("nhd,hde,nhe->nh", e, h, e)

    assert torch.all(weighted(out) <= weighted(plain))  # c = 0 is the store's own rounding
    assert float(weighted(out).mean()) < 0.97 * float(weighted(plain).mean())  # a few % on random keys
    on_a_grid = torch.zeros(N, HKV, dtype=torch.bool)
    for c in range(8):  # every row is codes times one of the candidate scales
        scale = k.abs().amax(-1, keepdim=True) / (448 * 2.0 ** (-c / 8))
        on_a_grid |= ((out / scale).to(torch.float8_e4m3fn).float() * scale == out).all(-1)
    assert bool(on_a_grid.all())


def test_output_grams_sum_each_kv_heads_query_heads_output_projection_gram():
    from types import SimpleNamespace as NS

    gen = torch.Generator().manual_seed(7)
    weights = [torch.randn(32, HQ * D, generator=gen) for _ in range(LAYERS)]  # o_proj: [hidden, Hq * D]
    layers = [NS(self_attn=NS(o_proj=NS(weight=w))) for w in weights]
    model = NS(hf=NS(base_model_prefix="model", model=NS(layers=layers)))
    grams = kv_variants.output_grams(model, HKV, D)
    group = HQ // HKV
    w = weights[1][:, group * D : (group + 1) * D]  # query head `group`: the first of KV head 1's group
    assert grams[1].shape == (HKV, D, D)
    cols = [weights[1][:, h * D : (h + 1) * D] for h in range(group, 2 * group)]  # KV head 1's query heads
    own = sum(c.T @ c for c in cols)
    assert torch.allclose(grams[1][1], own, rtol=1e-4, atol=1e-3) and not torch.allclose(grams[1][1], w.T @ w)
