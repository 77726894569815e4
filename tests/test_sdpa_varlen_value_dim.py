"""Keys and values of different widths (multi-head latent attention as transformers expands it:
DeepSeek-V3's 192-wide keys beside 128-wide values), and widths that are not powers of two.

The Triton kernels (the interpreter on CPU) against torch's own `scaled_dot_product_attention`, each
segment's resident keys gathered from NaN-poisoned stores (every slot no segment may read is NaN,
padding columns included), on the split, split_merge and long paths, bf16-like fp32 and e4m3
stores, with a window, a soft-cap and sinks; then the cache and the store (each plane at its own
width, the bytes of the real heads) and DeepSeek-V3's tiny random model matching transformers.
"""

from __future__ import annotations

import math

import pytest
import torch

from batchkv.cache import BatchedSequenceCache, CacheConfig
from batchkv.errors import ConfigError, ContractError
from batchkv.ops import sdpa_varlen_reference
from batchkv.ops.reference import dequantize_fp8, quantize_fp8
from batchkv.ops.sdpa.launch import SdpaConfig, _counters, sdpa_varlen
from batchkv.ops.support import refusal, to_scale_layout

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E4M3 = torch.float8_e4m3fn


def make_case(segments, *, rows, key_dim, value_dim, columns=5, kv_heads=2, group=2, pad=2, seed=0):
    """q [T, Hq, Dk] and NaN-poisoned stores k [rows, C, Hkv, Dk], v [rows, C, Hkv, Dv] for
    (q_len, col, kv_end) segments packed in order with `pad` uncovered rows after them."""
    gen = torch.Generator().manual_seed(seed)
    table, q_start = [], 0
    for q_len, col, kv_end in segments:
        table.append((q_start, q_len, col, kv_end))
        q_start += q_len
    q = torch.randn(q_start + pad, kv_heads * group, key_dim, generator=gen)
    k = torch.full((rows, columns, kv_heads, key_dim), float("nan"))
    v = torch.full((rows, columns, kv_heads, value_dim), float("nan"))
    for col in {c for _, c, _ in segments}:
        end = max(e for _, c, e in segments if c == col)
        for t in range(max(0, end - rows), end):
            k[t % rows, col] = torch.randn(kv_heads, key_dim, generator=gen)
            v[t % rows, col] = torch.randn(kv_heads, value_dim, generator=gen)
    return q, k, v, torch.tensor(table, dtype=torch.int32).reshape(-1, 4)


def torch_sdpa(q, k, v, info, *, window=0, scale=None, softcap=0.0, sinks=None):
    """torch's attention, segment by segment, over each segment's resident keys (the oracle)."""
    rows, hq, hkv = k.shape[0], q.shape[1], k.shape[2]
    out = torch.zeros(q.shape[0], hq, v.shape[-1])
    for q_start, q_len, col, kv_end in info.tolist():
        if not q_len:
            continue
        t = torch.arange(max(0, kv_end - rows), kv_end)
        keys = k[t % rows, col].repeat_interleave(hq // hkv, 1).transpose(0, 1)  # [Hq, N, Dk]
        values = v[t % rows, col].repeat_interleave(hq // hkv, 1).transpose(0, 1)
        pos = torch.arange(kv_end - q_len, kv_end)
        allowed = (t[None, :] <= pos[:, None]) & ((t[None, :] > pos[:, None] - window) if window else True)
        queries = q[q_start : q_start + q_len].transpose(0, 1)  # [Hq, q_len, Dk]
        if softcap or sinks is not None:  # the soft-cap and the sink are not torch SDPA's: written out here
            s = queries @ keys.transpose(1, 2) * (scale or 1 / math.sqrt(q.shape[-1]))
            s = softcap * torch.tanh(s / softcap) if softcap else s
            s = s.masked_fill(~allowed, float("-inf"))
            if sinks is not None:
                s = torch.cat([s, sinks[:, None, None].expand(hq, q_len, 1)], -1)
            o = torch.softmax(s, -1)[..., : keys.shape[1]] @ values
        else:
            o = torch.nn.functional.scaled_dot_product_attention(queries, keys, values, attn_mask=allowed, scale=scale)
        out[q_start : q_start + q_len] = o.transpose(0, 1)
    return out


def run(
    segments, *, key_dim, value_dim, e4m3=False, config=None, window=0, softcap=0.0, sinks=False, rows=40, v_apart=False
):
    """sdpa_varlen against torch SDPA; v_apart: V a view of a store with one more (NaN) column, so its
    row stride is not K's (the kernels' own V strides, not K's, even at one width)."""
    q, k, v, info = make_case(segments, rows=rows, key_dim=key_dim, value_dim=value_dim)
    extras = {"softcap": softcap} if softcap else {}
    if sinks:
        extras["sinks"] = torch.randn(q.shape[1], generator=torch.Generator().manual_seed(3))
    scales = {}
    if e4m3:  # the codes' values are the oracle's K and V
        (k, ks), (v, vs) = quantize_fp8(k), quantize_fp8(v)
        scales = {"k_scale": to_scale_layout(ks).to(DEVICE), "v_scale": to_scale_layout(vs).to(DEVICE)}
        k_ref, v_ref = dequantize_fp8(k, ks), dequantize_fp8(v, vs)
    else:
        k_ref, v_ref = k, v
    want = torch_sdpa(q, k_ref, v_ref, info, window=window, **extras)
    dev = [x.to(DEVICE) for x in (q, k, v, info)]
    if v_apart:
        wider = torch.full((v.shape[0], v.shape[1] + 1, *v.shape[2:]), float("nan"), device=DEVICE)
        wider[:, : v.shape[1]] = dev[2]
        dev[2] = wider[:, : v.shape[1]]
    extras = {n: x.to(DEVICE) if isinstance(x, torch.Tensor) else x for n, x in extras.items()}
    out = torch.full((q.shape[0], q.shape[1], value_dim), float("nan"), device=DEVICE)
    sdpa_varlen(*dev, out=out, config=config, window=window, **scales, **extras)
    ref = sdpa_varlen_reference(*dev, window=window, **scales, **extras)
    covered = torch.zeros(q.shape[0], dtype=torch.bool)
    for q_start, q_len, _, _ in info.tolist():
        covered[q_start : q_start + q_len] = True
    assert not out.isnan().any()
    torch.testing.assert_close(out.cpu()[covered], want[covered], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ref.cpu(), want, atol=1e-5, rtol=1e-5)  # the reference agrees with torch too
    assert torch.equal(out[~covered.to(DEVICE)], torch.zeros_like(out[~covered.to(DEVICE)]))
    assert not _counters(out.device, 0).any()


MIXED = [(1, 0, 30), (3, 2, 11), (0, 4, 0), (1, 1, 1), (20, 3, 37)]  # decode, verify, empty, first token, prefill
WIDTHS = [(48, 32), (32, 48), (48, 48), (32, 16)]  # keys wider, values wider, both padded, both powers of two


@pytest.mark.parametrize(("key_dim", "value_dim"), WIDTHS)
def test_a_mixed_table_matches_torch_sdpa_with_keys_and_values_of_their_own_widths(key_dim, value_dim):
    run(MIXED, key_dim=key_dim, value_dim=value_dim, config=SdpaConfig(block_m_long=16, q_short=4))


@pytest.mark.parametrize(("key_dim", "value_dim"), [(32, 32), (48, 32)])
def test_values_laid_out_unlike_the_keys_are_read_at_their_own_strides_on_every_path(key_dim, value_dim):
    run(MIXED, key_dim=key_dim, value_dim=value_dim, config=SdpaConfig(block_m_long=16, q_short=4), v_apart=True)
    run([(1, 1, 33), (2, 0, 9)], key_dim=key_dim, value_dim=value_dim, v_apart=True,
        config=SdpaConfig(split_merge=True, programs=3))  # fmt: skip


def test_the_split_merge_path_and_several_heads_per_program_take_separate_widths():
    run([(1, 1, 33), (2, 0, 9)], key_dim=48, value_dim=32, config=SdpaConfig(split_merge=True, programs=3))
    run(MIXED, key_dim=48, value_dim=32, config=SdpaConfig(heads=2, block_m_long=16, q_short=4, programs=2))


def test_a_window_a_soft_cap_and_sinks_apply_with_separate_widths():
    run(MIXED, key_dim=48, value_dim=32, window=5, softcap=2.0, sinks=True, config=SdpaConfig(q_short=4))


def test_e4m3_stores_of_separate_widths_match_torch_sdpa_on_their_codes():
    run(MIXED, key_dim=48, value_dim=32, e4m3=True, config=SdpaConfig(q_short=4, e4m3_qk_long=False))


def _one_step(cfg: CacheConfig, attention: str):
    """Three tokens of one new sequence through layer 0 of a cache: (q, k, v, out, the cache)."""
    cache = BatchedSequenceCache(cfg, DEVICE, attention=attention)
    seq = cache.seq_new()
    cache.declare_step([seq] * 3)
    cache.prepare_step(width=3)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, h, d, generator=gen).to(DEVICE) for h, d in ((4, 48), (2, 48), (2, 32)))
    return q, k, v, cache.update_and_attend(0, q, k, v), cache


GEOMETRY = dict(num_layers=2, kv_heads=2, head_dim=48, value_dim=32, max_seqs=2, capacity=16, max_write=4,
                dtype=torch.float32)  # fmt: skip


@pytest.mark.parametrize("attention", ["reference", "triton"])
def test_the_cache_writes_each_width_attends_like_torch_and_holds_the_real_bytes(attention):
    cfg = CacheConfig(**GEOMETRY)
    assert cfg.planes["k"][0] == (1, 2, 48) and cfg.planes["v"][0] == (1, 2, 32)
    assert cfg.bytes_per_position() == 2 * 2 * (48 + 32) * 4  # layers x heads x (K + V widths) x fp32
    q, k, v, out, cache = _one_step(cfg, attention)
    assert out.shape == (3, 4, 32)
    assert cache.k_store(0).shape[-1] == 48 and cache.v_store(0).shape[-1] == 32
    info = torch.tensor([[0, 3, 0, 3]], dtype=torch.int32)
    want = torch_sdpa(q.cpu(), k.cpu()[:, None], v.cpu()[:, None], info)
    torch.testing.assert_close(out.cpu(), want, atol=1e-5, rtol=1e-5)


def test_a_value_of_the_wrong_width_is_refused_and_widths_the_kernels_cannot_tile_too():
    cfg = CacheConfig(**GEOMETRY)
    cache = BatchedSequenceCache(cfg, "cpu", attention="reference")
    seq = cache.seq_new()
    cache.declare_step([seq])
    cache.prepare_step(width=1)
    with pytest.raises(ContractError, match=r"v must be \[W, Hkv, Dv\] = \[1, 2, 32\]"):
        cache.update_and_attend(0, torch.randn(1, 4, 48), torch.randn(1, 2, 48), torch.randn(1, 2, 48))
    assert refusal(torch.bfloat16, 192, value_dim=128) is None  # DeepSeek-V3's heads
    assert "value_dim 24" in refusal(torch.bfloat16, 192, value_dim=24)
    with pytest.raises(ConfigError, match="value_dim 24"):
        BatchedSequenceCache(CacheConfig(**{**GEOMETRY, "value_dim": 24}), "cpu", attention="triton")


def test_deepseek_v3_is_served_with_192_wide_keys_and_128_wide_values_in_the_store():
    pytest.importorskip("transformers")
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from batchkv.executor import Engine
    from batchkv.models.hf import HFModel

    config = DeepseekV3Config(vocab_size=64, hidden_size=64, intermediate_size=64, moe_intermediate_size=16,
                              num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16,
                              q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                              n_routed_experts=2, num_experts_per_tok=1, n_group=1, topk_group=1,
                              max_position_embeddings=64)  # fmt: skip
    model = HFModel(DeepseekV3ForCausalLM(config))
    spec = model.cache_spec()
    assert (spec["head_dim"], spec["value_dim"]) == (192, 128)
    engine = Engine(model, max_seqs=1, capacity=16, max_step_tokens=8, prefill_chunk=8)
    try:
        store = engine.cache.config
        assert (store.head_dim, store.value_dim) == (192, 128)
        # K and V bytes per position are those of the real heads: 192 + 128 (not 2 x 192)
        assert store.bytes_per_position() == 1 * 2 * (192 + 128) * 4
    finally:
        engine.close()
