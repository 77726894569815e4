"""`SdpaConfig.e4m3_qk_long`: the long path's QK^T as an e4m3 dot of quantised queries, on CPU.

The variant rounds q to e4m3 (`quantize_queries`: one scale per (query, head) row), so it is
checked twice: against the reference fed those same rounded queries, where only fp16's rounding
of p in the PV dot remains (Triton's interpreter runs e4m3 dots as exact fp32 products and sums),
and against the reference on the exact queries within a bound derived from each row's rounding.
Stores are NaN-poisoned as in tests/test_fp8_kernels.py.
"""

from __future__ import annotations

import pytest
import torch

from batchkv.ops import sdpa_varlen_reference
from batchkv.ops.reference import dequantize_fp8, quantize_fp8, quantize_queries
from batchkv.ops.sdpa.launch import SdpaConfig, _counters, sdpa_varlen
from batchkv.ops.support import to_scale_layout
from tests.test_sdpa_varlen import make_case

QK = dict(e4m3_qk_long=True, block_m_long=32)
CASES = {  # long segments (q_len > 16) beside short ones, D >= 32 (e4m3 dots contract >= 32)
    "prefill, GQA 4": dict(segments=[(40, 1, 40), (40, 0, 113), (1, 2, 30)], rows=120, config=SdpaConfig(**QK)),
    "unmasked interiors, 16-key tiles": dict(segments=[(24, 0, 300), (17, 3, 57)], rows=310, kv_heads=1, group=2,
                                            config=SdpaConfig(**QK, block_n_long=16)),
    "wrapped ring and window, D 64": dict(segments=[(40, 1, 40), (33, 0, 150), (20, 2, 400)], rows=64, head_dim=64,
                                          group=2, window=60, config=SdpaConfig(**QK, block_n_long=16)),
    "non-causal window": dict(segments=[(17, 0, 70), (40, 2, 100), (3, 1, 9)], rows=110, causal=False, window=6,
                              kv_heads=1, config=SdpaConfig(**QK)),
    "non-causal, GQA 1": dict(segments=[(21, 0, 45), (18, 1, 18)], rows=50, causal=False, group=1, kv_heads=4,
                              config=SdpaConfig(**QK, block_n_long=16)),
    "odd lengths, uncovered rows": dict(segments=[(19, 0, 23), (0, 1, 5), (37, 1, 61), (29, 4, 29)], rows=64, gap=3,
                                        pad=5, group=3, config=SdpaConfig(**QK)),
    "default tiles": dict(segments=[(70, 0, 200), (33, 1, 33)], rows=256, config=SdpaConfig(e4m3_qk_long=True)),
    # config None: the default takes the variant on e4m3 stores, its narrow config (tables of <= 2 rows) too
    "the default": dict(segments=[(70, 0, 200), (33, 1, 33), (1, 2, 30)], rows=256, config=None),
    "the default, a one-sequence table": dict(segments=[(40, 0, 120)], rows=128, config=None),
}  # fmt: skip


def run(segments, *, causal=True, window=0, config=None, **case):
    """(out, reference on the e4m3-rounded queries, reference on the exact queries, V's max |value|,
    the covered rows, the case's tensors): q in fp16, e4m3 codes of NaN-poisoned stores."""
    (q, k, v), info = make_case(segments, **case)
    (k_codes, k_scale), (v_codes, v_scale) = quantize_fp8(k), quantize_fp8(v)
    scales = dict(k_scale=to_scale_layout(k_scale), v_scale=to_scale_layout(v_scale))
    q = q.half()
    out = torch.full_like(q, float("nan"))
    sdpa_varlen(q, k_codes, v_codes, info, causal=causal, window=window, config=config, out=out, **scales)
    ref_rounded = sdpa_varlen_reference(dequantize_fp8(*quantize_queries(q)), k_codes, v_codes, info, causal=causal,
                                        window=window, **scales)  # fmt: skip
    ref_exact = sdpa_varlen_reference(q.float(), k_codes, v_codes, info, causal=causal, window=window, **scales)
    covered = torch.zeros(q.shape[0], dtype=torch.long)  # 1: a short segment's row (split path), 2: a long one's
    for q_start, q_len, _, _ in info.tolist():
        covered[q_start : q_start + q_len] = 1 + (q_len > 16)
    v_max = dequantize_fp8(v_codes, v_scale).nan_to_num(0.0).abs().max()
    return out.float(), ref_rounded.float(), ref_exact.float(), v_max, covered, (q, k_codes, k_scale, info)


@pytest.mark.parametrize("case", list(CASES))
def test_e4m3_qk_matches_the_reference_on_the_same_rounded_queries(case):
    out, ref, exact, v_max, covered, _ = run(**CASES[case])
    assert not out.isnan().any() and (covered == 2).any()
    # Scores are exact e4m3 products summed in fp32 on both sides; p enters the PV dot in fp16
    # (normal, thanks to P_SHIFT): each weight moves by <= 2^-11 of itself, the output by <= 2^-10 max|v|.
    long = covered == 2
    torch.testing.assert_close(out[long], ref[long], atol=2**-10 * v_max.item(), rtol=0)
    short = covered == 1  # the split path: q stays fp16 there, as without the variant
    torch.testing.assert_close(out[short], exact[short], atol=2e-3, rtol=1e-4)
    assert torch.equal(out[covered == 0], torch.zeros_like(out[covered == 0]))
    assert not _counters(out.device, 0).any()


def test_e4m3_qk_error_against_exact_queries_stays_within_the_rounding_bound():
    # Rounding q moves score (i, j) by scale * |sum_d (q^ - q)_d k_jd| <= eps_i = scale * max_j
    # sum_d |q^ - q|_d |k_jd|; softmax weights then move by a factor within e^(+-2 eps_i), so row i's
    # output by <= (e^(2 eps_i) - 1) max|v|, plus fp16's 2^-10 max|v| for p. One long segment, no window.
    segments = [(48, 0, 90)]
    out, _, exact, v_max, _, (q, k_codes, k_scale, _) = run(segments, rows=96, config=SdpaConfig(**QK))
    k = dequantize_fp8(k_codes[:90, 0], k_scale[:90, 0])  # [90, Hkv, D], the keys the segment attends
    q_err = (dequantize_fp8(*quantize_queries(q)) - q.float()).abs()  # [T, Hq, D]
    group = q.shape[1] // k.shape[1]
    dev = torch.einsum("thd,jhd->thj", q_err, k.abs().repeat_interleave(group, 1))
    eps = dev.amax(-1) / q.shape[-1] ** 0.5  # [T, Hq]
    bound = (torch.exp(2 * eps) - 1 + 2**-10) * v_max
    err = (out - exact).abs().amax(-1)
    assert (err <= bound).all()
    assert 0 < err.max() < 0.1 * v_max  # q's rounding shows, and stays small: it is not the identity


def test_e4m3_qk_is_ignored_where_it_does_not_apply():
    # fp32 queries keep IEEE dots, and a negative scale keeps the default path: same output as without
    case = dict(segments=[(20, 0, 40)], rows=48)
    (q, k, v), info = make_case(**case)
    (kc, ks), (vc, vs) = quantize_fp8(k), quantize_fp8(v)
    scales = dict(k_scale=to_scale_layout(ks), v_scale=to_scale_layout(vs))
    for q_in, scale in ((q, None), (q.half(), -0.2)):
        with_qk = sdpa_varlen(q_in, kc, vc, info, scale=scale, config=SdpaConfig(**QK), **scales)
        without = sdpa_varlen(q_in, kc, vc, info, scale=scale, config=SdpaConfig(block_m_long=32), **scales)
        assert torch.equal(with_qk, without)


@pytest.mark.parametrize("scale", [None, 1e-30])
def test_e4m3_qk_rows_of_nan_or_zero_queries_come_out_as_with_exact_queries(scale):
    # a query row holding a NaN takes a NaN scale (tl.max skips NaN), so it goes where exact queries'
    # NaN scores go; a zero row's scale is the floor, and with a tiny softmax scale their product stays
    # a normal float (a zero would make exp2's argument -inf * 0): uniform weights, as exact queries give
    case = dict(segments=[(40, 0, 90), (1, 1, 30)], rows=96)
    (q, k, v), info = make_case(**case)
    (kc, ks), (vc, vs) = quantize_fp8(k), quantize_fp8(v)
    scales = dict(k_scale=to_scale_layout(ks), v_scale=to_scale_layout(vs))
    q = q.half()
    q[3, 1, 5], q[7, 2], q[39, 0] = float("nan"), 0.0, 0.0
    with_qk = sdpa_varlen(q, kc, vc, info, scale=scale, config=SdpaConfig(**QK), **scales).float()
    exact = sdpa_varlen(q, kc, vc, info, scale=scale, config=SdpaConfig(block_m_long=32), **scales).float()
    v_max = dequantize_fp8(vc, vs).nan_to_num(0.0).abs().max().item()
    for t, h in ((3, 1), (7, 2), (39, 0)):
        torch.testing.assert_close(with_qk[t, h], exact[t, h], atol=2**-10 * v_max, rtol=0, equal_nan=True)
    assert exact[7, 2].abs().sum() > 0  # a zero row attends (uniformly), it is not an empty row


@pytest.mark.gpu
@pytest.mark.parametrize("window", [0, 700])
@pytest.mark.parametrize("config", [SdpaConfig(e4m3_qk_long=True), None], ids=["explicit", "default"])
def test_e4m3_qk_on_the_gpu_at_the_sensenova_shape_matches_the_reference_on_the_rounded_queries(window, config):
    # two 512-token prompt chunks over histories (the serving step's prefill) beside decode rows,
    # bf16 queries, Hq 32 / Hkv 8, D 128; the ring wraps for the first chunk (kv_end 2048 > 1600 rows)
    from tests.test_sdpa_varlen_gpu import poisoned_store, table

    gen = torch.Generator(device="cuda").manual_seed(0)
    q_lens, kv_ends, cols = [512, 1, 512, 3], [2048, 900, 1536, 40], [5, 0, 17, 33]
    k, v = poisoned_store(1600, 8, 128, torch.float32, kv_ends, cols, gen)
    (kc, ks), (vc, vs) = quantize_fp8(k), quantize_fp8(v)
    scales = dict(k_scale=to_scale_layout(ks), v_scale=to_scale_layout(vs))
    info, width = table(q_lens, kv_ends, cols, 8)
    q = torch.randn(width + 2, 32, 128, generator=gen, device="cuda").bfloat16()
    out = torch.full_like(q, float("nan"))
    sdpa_varlen(q, kc, vc, info, window=window, out=out, config=config, **scales)
    ref = sdpa_varlen_reference(dequantize_fp8(*quantize_queries(q)), kc, vc, info, window=window, **scales)
    exact = sdpa_varlen_reference(q, kc, vc, info, window=window, **scales)
    long = torch.zeros(width + 2, dtype=torch.bool, device="cuda")
    long[:512], long[513:1025] = True, True
    assert not out.isnan().any() and torch.equal(out[width:], torch.zeros_like(out[width:]))
    # bf16 output (2^-9 relative), fp16 p (2^-10 max|v|), and sm_90's e4m3 MMA, which keeps fewer
    # than fp32's bits while it sums (a score of ~|q||k| off by ~2^-13 of it)
    torch.testing.assert_close(out[long].float(), ref[long].float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out[~long].float(), exact[~long].float(), atol=2e-2, rtol=2e-2)
    rel = (out[long].float() - exact[long].float()).norm() / exact[long].float().norm()
    assert rel < 5e-2  # what rounding q to e4m3 costs against exact queries (~2.5% on N(0, 1) data)
