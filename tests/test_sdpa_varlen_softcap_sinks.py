"""Logit soft-capping (Gemma2) and attention sinks (gpt-oss) in sdpa_varlen, against the reference.

Every path is checked under the interpreter on NaN-poisoned stores (`tests.test_sdpa_varlen.make_case`):
the stream-K split path with items one program writes alone and items merged from many partials,
the two-launch split_merge variant, warp-split tiles, several KV heads per program, the long path,
windows over wrapped rings, e4m3 stores (exact queries under a cap; e4m3-rounded queries with sinks
alone). A sink must join each row's normaliser once, however many programs share the row's keys.
The reference itself is checked against transformers' own eager formulas (Gemma2's cap after the
scale, gpt-oss's concatenated sink column).
"""

from __future__ import annotations

import math

import pytest
import torch

from batchkv.errors import ContractError
from batchkv.ops import sdpa_varlen_reference
from batchkv.ops.reference import dequantize_fp8, quantize_fp8, quantize_queries
from batchkv.ops.sdpa.launch import SdpaConfig, _counters, sdpa_varlen
from batchkv.ops.support import to_scale_layout
from tests.test_sdpa_varlen import DEVICE, make_case

SCALE = 0.5  # large scores (|s| ~ 3 at D 32), so a cap of 2 bends most of them
CAP = 2.0
EXTRAS = {"softcap": dict(softcap=CAP), "sinks": dict(sinks=True), "both": dict(softcap=CAP, sinks=True)}


def _sinks(heads: int) -> torch.Tensor:
    """One logit per query head, from a sink that takes almost every row's mass to one that takes none."""
    return torch.linspace(-6.0, 6.0, heads, device=DEVICE)


def check(segments, *, extras, config=None, causal=True, window=0, atol=2e-5, **case):
    """sdpa_varlen with `extras` (softcap, sinks) into a NaN-filled out equals the reference; rows no
    segment covers stay exact zeros; the merge counters are zero afterwards."""
    (q, k, v), info = make_case(segments, **case)
    kw = dict(extras)
    if kw.pop("sinks", False):
        kw["sinks"] = _sinks(q.shape[1])
    out = sdpa_varlen(q, k, v, info, scale=SCALE, causal=causal, window=window, config=config,
                      out=torch.full_like(q, float("nan")), **kw)  # fmt: skip
    ref = sdpa_varlen_reference(q, k, v, info, scale=SCALE, causal=causal, window=window, **kw)
    plain = sdpa_varlen_reference(q, k, v, info, scale=SCALE, causal=causal, window=window)
    covered = torch.zeros(q.shape[0], dtype=torch.bool)
    for q_start, q_len, _, _ in info.tolist():
        covered[q_start : q_start + q_len] = True
    assert not out.isnan().any()
    torch.testing.assert_close(out[covered], ref[covered], atol=atol, rtol=1e-4)
    assert torch.equal(out[~covered], torch.zeros_like(out[~covered]))
    assert not _counters(q.device, 0).any()
    assert not torch.allclose(ref[covered], plain[covered], atol=1e-3)  # the case exercises the extras
    return out, ref


@pytest.mark.parametrize("extras", list(EXTRAS))
@pytest.mark.parametrize("group", [1, 4])
def test_decode_on_the_split_path_matches_reference(extras, group):
    check([(1, 0, 1), (1, 3, 17), (1, 1, 130), (2, 4, 257)], rows=260, group=group, kv_heads=8 // group,
          extras=EXTRAS[extras])  # fmt: skip


@pytest.mark.parametrize("extras", ["sinks", "both"])
@pytest.mark.parametrize(("programs", "min_blocks"), [(1, 1), (50, 1), (7, 3)])
def test_a_sink_counts_once_per_row_however_many_programs_share_its_keys(extras, programs, min_blocks):
    # 1: one program writes every item itself; 50: the long item merged from many partials
    config = SdpaConfig(programs=programs, min_blocks=min_blocks, block_n=16)
    check([(1, 0, 70), (3, 2, 33), (1, 1, 590)], rows=600, head_dim=16, kv_heads=1, config=config,
          extras=EXTRAS[extras])  # fmt: skip


@pytest.mark.parametrize("extras", list(EXTRAS))
def test_the_split_merge_variant_matches_reference(extras):
    config = SdpaConfig(split_merge=True, block_n=16, programs=5)
    check([(1, 0, 200), (0, 2, 9), (1, 1, 57)], rows=210, head_dim=16, config=config, extras=EXTRAS[extras])


def test_warp_split_tiles_and_several_heads_per_program_match_reference():
    check([(1, 0, 150), (3, 1, 40)], rows=160, head_dim=16, kv_heads=1, extras=EXTRAS["both"],
          config=SdpaConfig(warp_split=2, block_n=32, programs=4))  # fmt: skip
    check([(1, 0, 150), (3, 1, 40)], rows=160, head_dim=16, kv_heads=4, group=2, extras=EXTRAS["both"],
          config=SdpaConfig(heads=2, block_n=16, programs=4))  # fmt: skip


@pytest.mark.parametrize("extras", list(EXTRAS))
def test_prefill_chunks_on_the_long_path_match_reference(extras):
    check([(40, 1, 40), (1, 2, 30), (33, 0, 113)], rows=120, head_dim=16, config=SdpaConfig(block_m_long=32),
          extras=EXTRAS[extras])  # fmt: skip


def test_a_window_over_a_wrapped_ring_and_non_causal_blocks_match_reference():
    check([(1, 0, 301), (5, 1, 57), (20, 2, 44)], rows=24, window=20, head_dim=16, extras=EXTRAS["both"])
    check([(4, 0, 70), (20, 1, 33)], rows=80, causal=False, window=6, head_dim=16, kv_heads=1, extras=EXTRAS["both"])


def test_rows_without_a_resident_key_are_zeros_with_a_sink():
    out, _ = check([(40, 0, 90), (1, 1, 30)], rows=16, head_dim=16, extras=EXTRAS["both"])
    assert torch.equal(out[:24], torch.zeros_like(out[:24]))  # positions 50..73 have no resident key


@pytest.mark.parametrize("extras", list(EXTRAS))
@pytest.mark.parametrize("config", [None, SdpaConfig(split_merge=True, block_n=16, programs=3)])
def test_e4m3_stores_match_reference_on_their_codes(extras, config):
    # the default rounds prompt chunks' queries to e4m3, but not under a cap: the reference gets the
    # rounded queries for the long rows only when no cap is asked
    (q, k, v), info = make_case([(1, 0, 200), (40, 1, 57), (3, 2, 30)], rows=210, head_dim=32, pad=2)
    q = q.half()
    (k_codes, k_scale), (v_codes, v_scale) = quantize_fp8(k), quantize_fp8(v)
    kw = dict(EXTRAS[extras], k_scale=to_scale_layout(k_scale), v_scale=to_scale_layout(v_scale))
    if kw.pop("sinks", False):
        kw["sinks"] = _sinks(q.shape[1])
    out = sdpa_varlen(q, k_codes, v_codes, info, scale=SCALE, config=config, out=torch.full_like(q, float("nan")), **kw)
    q_ref = q.float() if kw.get("softcap") or config is not None else dequantize_fp8(*quantize_queries(q))
    q_ref[:1] = q[:1].float()
    q_ref[41:] = q[41:].float()  # short segments keep exact queries
    ref = sdpa_varlen_reference(q_ref, k_codes, v_codes, info, scale=SCALE, **kw)
    torch.testing.assert_close(out[:44].float(), ref[:44], atol=2e-3, rtol=2e-3)  # fp16 p in the PV dots
    assert torch.equal(out[44:], torch.zeros_like(out[44:]))


def _gemma2_eager(q, k, v, scale, softcap):
    """transformers' Gemma2 eager attention scores on [H, Q, D] x [H, K, D], causal, no mask beyond it."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    module = torch.nn.Module()
    module.num_key_value_groups, module.training = 1, False
    mask = torch.full((q.shape[1], k.shape[1]), float("-inf")).triu(k.shape[1] - q.shape[1] + 1)
    out, _ = eager_attention_forward(module, q[None], k[None], v[None], mask[None, None], scaling=scale,
                                     softcap=softcap)  # fmt: skip
    return out[0]  # [Q, H, D]


def _gpt_oss_eager(q, k, v, scale, sinks):
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    module = torch.nn.Module()
    module.num_key_value_groups, module.training, module.sinks = 1, False, sinks
    mask = torch.full((q.shape[1], k.shape[1]), float("-inf")).triu(k.shape[1] - q.shape[1] + 1)
    out, _ = eager_attention_forward(module, q[None], k[None], v[None], mask[None, None], scaling=scale)
    return out[0]


@pytest.mark.parametrize("model", ["gemma2", "gpt-oss"])
def test_the_reference_equals_transformers_eager_attention(model):
    gen = torch.Generator().manual_seed(3)
    heads, n, d = 4, 9, 16
    q, k, v = (torch.randn(heads, m, d, generator=gen, dtype=torch.float64).float() for m in (3, n, n))
    store_k, store_v = k.transpose(0, 1)[:, None].contiguous(), v.transpose(0, 1)[:, None].contiguous()
    info = torch.tensor([[0, 3, 0, n]], dtype=torch.int32)
    if model == "gemma2":
        want = _gemma2_eager(q, k, v, SCALE, CAP)
        got = sdpa_varlen_reference(q.transpose(0, 1).contiguous(), store_k, store_v, info, scale=SCALE, softcap=CAP)
    else:
        sinks = torch.tensor([-2.0, 0.0, 1.5, 4.0])
        want = _gpt_oss_eager(q, k, v, SCALE, sinks)
        got = sdpa_varlen_reference(q.transpose(0, 1).contiguous(), store_k, store_v, info, scale=SCALE, sinks=sinks)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


BAD = {
    "a negative cap": dict(softcap=-1.0),
    "an infinite cap": dict(softcap=math.inf),
    "a cap that is a bool": dict(softcap=True),
    "sinks of the KV heads' count": dict(sinks=torch.zeros(2)),
    "integer sinks": dict(sinks=torch.zeros(8, dtype=torch.int32)),
    "sinks as a list": dict(sinks=[0.0] * 8),
    "strided sinks": dict(sinks=torch.zeros(16)[::2]),
}


@pytest.mark.parametrize("breach", list(BAD))
def test_bad_caps_and_sinks_raise_contract_error(breach):
    (q, k, v), info = make_case([(1, 0, 5)], rows=8, head_dim=16)
    with pytest.raises(ContractError):
        sdpa_varlen(q, k, v, info, **BAD[breach])
