"""e4m3 K/V storage in the kernels, under the interpreter on CPU at small shapes.

The Triton write stores exactly what `quantize_fp8` stores (codes and scales, bit for bit), and
sdpa_varlen over e4m3 codes and fp32 scales equals the torch reference on the same codes at fp32
tolerance across the kernel suite's shapes. Stores start poisoned: NaN codes (0x7F) and NaN
scales everywhere a segment may not read, so a stray read turns the output into NaN (Triton's
interpreter decodes code 0x7F as 480, so the NaN scale is the tripwire there). Scale planes are
in the store's layout (`empty_scales`: [rows, C, Hkv] over [C, Hkv, rows] storage) unless a test
says otherwise: the kernels take any strides.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import triton
import triton.language as tl

from batchkv.errors import ContractError
from batchkv.ops import sdpa_varlen_reference
from batchkv.ops.kv_write_triton import kv_write
from batchkv.ops.reference import dequantize_fp8, kv_write_reference, quantize_fp8
from batchkv.ops.sdpa.common import unpack_pairs
from batchkv.ops.sdpa.launch import DEFAULT_CONFIG, SdpaConfig, _counters, sdpa_varlen
from batchkv.ops.support import FP8, SCALE_FLOOR, empty_scales, to_scale_layout
from tests.test_sdpa_varlen import DEVICE, make_case


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8 else t.view(torch.int32)


# ---- the write --------------------------------------------------------------------------------------
def poisoned_flat(rows: int, columns: int, kv_heads: int, head_dim: int):
    """NaN codes [rows * C, Hkv, D] and NaN scale planes [rows, C, Hkv] in the store's layout, K and V."""
    codes = torch.full((rows * columns, kv_heads, head_dim), float("nan"), device=DEVICE).to(FP8)
    scales = [empty_scales(rows, columns, kv_heads, device=DEVICE).fill_(float("nan")) for _ in range(2)]
    return codes, codes.clone(), *scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_triton_write_stores_the_reference_codes_and_scales_bit_for_bit(dtype):
    gen = torch.Generator().manual_seed(0)
    width, kv_heads, head_dim = 9, 3, 32
    # magnitudes 1e-12 .. 1e8 across rows (e4m3 subnormals included), strided views of one projection
    spread = torch.logspace(-12, 8, width)[:, None, None, None]
    kv = (torch.randn(width, 2, kv_heads, head_dim, generator=gen) * spread).to(dtype)
    kv[2, 0, 1] = 0.0  # an all-zero row
    kv[3, 1, 0, :4] = -0.0
    k, v = kv[:, 0].to(DEVICE), kv[:, 1].to(DEVICE)
    slots = torch.randperm(40, generator=gen)[:width].to(DEVICE)  # 8 rows of 5 columns
    got, want = poisoned_flat(8, 5, kv_heads, head_dim), poisoned_flat(8, 5, kv_heads, head_dim)
    kv_write(got[0], got[1], k, v, slots, k_scale=got[2], v_scale=got[3])
    kv_write_reference(want[0], want[1], k, v, slots, k_scale=want[2], v_scale=want[3])
    for g, w in zip(got, want, strict=True):
        assert torch.equal(bits(g), bits(w))  # NaN poison included: slots not written stay untouched
    row, col = divmod(slots[2].item(), 5)
    assert torch.equal(got[0][slots[2], 1].float(), torch.zeros(head_dim)) and got[2][row, col, 1] == SCALE_FLOOR


def test_quantize_fp8_keeps_each_element_within_half_an_e4m3_step():
    # e4m3 has 3 mantissa bits: rounding moves a normal value by at most 2^-4 of itself; below the
    # smallest normal (2^-6 * scale) by at most half the subnormal step, 2^-10 * scale.
    x = torch.randn(64, 4, 128, generator=torch.Generator().manual_seed(1)) * torch.logspace(-3, 3, 128)
    codes, scale = quantize_fp8(x)
    err = (dequantize_fp8(codes, scale) - x).abs()
    bound = torch.maximum(x.abs() * 2**-4, scale[..., None] * 2**-10) * (1 + 1e-6)
    assert (err <= bound).all()
    amax = dequantize_fp8(codes, scale).abs().amax(-1)  # code 448 * (amax / 448): amax to one fp32 rounding
    torch.testing.assert_close(amax, x.abs().amax(-1), rtol=2**-23, atol=0)


# ---- attention ------------------------------------------------------------------------------------
@triton.jit
def _unpack_probe(pairs, even, odd, BLOCK: tl.constexpr, CVT_ASM: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    e, o = unpack_pairs(tl.load(pairs + i), tl.float16, CVT_ASM)
    tl.store(even + i, e)
    tl.store(odd + i, o)


def unpack_every_pair(cvt_asm: bool, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`unpack_pairs` of all 65536 int16 patterns -> (even, odd, and torch's fp16 of the low and high bytes)."""
    pairs = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).to(device)
    even, odd = torch.empty(2, 2**16, dtype=torch.float16, device=device)
    _unpack_probe[(64,)](pairs, even, odd, BLOCK=1024, CVT_ASM=cvt_asm)
    codes = pairs.view(torch.uint8).view(-1, 2).view(FP8)  # little-endian: byte 0 is the even column's code
    return even, odd, codes[:, 0].to(torch.float16), codes[:, 1].to(torch.float16)


def test_unpack_pairs_turns_every_int16_into_its_low_and_high_bytes_e4m3_values():
    even, odd, want_even, want_odd = unpack_every_pair(False, DEVICE)
    finite = ~(want_even.isnan() | want_odd.isnan())  # the interpreter decodes e4m3's NaN code as 480
    assert finite.sum() == 254 * 254  # 0x7F and 0xFF are e4m3fn's only NaN codes
    assert torch.equal(even[finite], want_even[finite]) and torch.equal(odd[finite], want_odd[finite])


def check_fp8(segments, *, causal=True, window=0, config=None, q_dtype=torch.float32, atol=2e-5, layout=None,
              **case):  # fmt: skip
    """sdpa_varlen on e4m3 codes of NaN-poisoned stores equals the reference on the same codes;
    scale planes in the store's layout, or `layout(scales)`."""
    (q, k, v), info = make_case(segments, **case)  # fp32, NaN past every kv_end and in unused columns
    (k_codes, k_scale), (v_codes, v_scale) = quantize_fp8(k), quantize_fp8(v)
    assert k_scale.isnan().any() and bits(k_codes).eq(0x7F).any()  # the poison survives quantisation
    q = q.to(q_dtype)
    scales = {name: (layout or to_scale_layout)(s) for name, s in (("k_scale", k_scale), ("v_scale", v_scale))}
    out = torch.full_like(q, float("nan"))
    sdpa_varlen(q, k_codes, v_codes, info, causal=causal, window=window, config=config, out=out, **scales)
    ref = sdpa_varlen_reference(q, k_codes, v_codes, info, causal=causal, window=window, **scales)
    covered = torch.zeros(q.shape[0], dtype=torch.bool)
    for q_start, q_len, _, _ in info.tolist():
        covered[q_start : q_start + q_len] = True
    assert not out.isnan().any()
    torch.testing.assert_close(out[covered].float(), ref[covered].float(), atol=atol, rtol=1e-4)
    assert torch.equal(out[~covered], torch.zeros_like(out[~covered]))
    assert not _counters(q.device, 0).any()


SHORT = SdpaConfig(block_n=16)
CASES = {  # the kernel suite's shapes (tests/test_sdpa_varlen.py), on e4m3 storage
    "decode gqa 1": dict(segments=[(1, 0, 1), (1, 3, 17), (1, 1, 130)], rows=140, group=1, kv_heads=4, head_dim=16),
    "decode gqa 8": dict(segments=[(1, 0, 1), (1, 3, 17), (1, 4, 257)], rows=260, group=8, kv_heads=1),
    "verify blocks": dict(segments=[(3, 2, 8), (16, 0, 95)], rows=100, kv_heads=1, head_dim=16),
    "prefill long path": dict(segments=[(40, 1, 40), (40, 0, 113)], rows=120, head_dim=16,
                              config=SdpaConfig(block_m_long=32)),
    "mixed split runs": dict(segments=[(1, 3, 200), (4, 0, 63), (0, 4, 0), (40, 1, 77), (2, 0, 65), (1, 2, 1)],
                             rows=210, group=3, head_dim=16),
    "sliding window": dict(segments=[(1, 0, 150), (3, 1, 49), (40, 2, 90)], rows=160, window=7, head_dim=16,
                           kv_heads=1),
    "wrapped ring": dict(segments=[(1, 0, 301), (5, 1, 57), (3, 2, 24)], rows=24, window=20, head_dim=16),
    "non-causal window": dict(segments=[(4, 0, 70), (16, 1, 33), (40, 2, 100)], rows=110, causal=False, window=6,
                              head_dim=16, kv_heads=1),
    "one program per head": dict(segments=[(1, 0, 70), (3, 2, 33), (1, 1, 300)], rows=310, head_dim=16,
                                 kv_heads=1, config=SdpaConfig(programs=1, block_n=16)),
    "many programs merged": dict(segments=[(1, 0, 700), (3, 1, 45)], rows=710, head_dim=16, kv_heads=1,
                                 config=SdpaConfig(programs=50, block_n=16)),
    "unmasked interiors": dict(segments=[(1, 0, 301), (5, 1, 157), (16, 2, 99)], rows=120, window=70, head_dim=16,
                               kv_heads=1, config=SdpaConfig(programs=3, block_n=16)),
    "two heads per program": dict(segments=[(1, 0, 129), (4, 1, 300), (16, 3, 90), (40, 4, 60)], rows=300,
                                  kv_heads=4, group=2, head_dim=16, config=SdpaConfig(heads=2, block_n=16)),
    "two heads per program, D 32": dict(segments=[(1, 0, 129), (4, 1, 300), (16, 3, 90)], rows=300, kv_heads=4,
                                        group=2, head_dim=32, config=SdpaConfig(heads=2, block_n=16)),
    "head_dim 64, 128-key tiles": dict(segments=[(1, 0, 129), (5, 1, 300)], rows=300, head_dim=64, group=2,
                                       config=SdpaConfig(block_n=128)),
    "prefill long path, D 64, ring and window": dict(segments=[(40, 1, 40), (33, 0, 150), (1, 2, 90)], rows=120,
                                                     head_dim=64, group=2, window=70,
                                                     config=SdpaConfig(block_m_long=32, block_n_long=16)),
    "fp16 queries": dict(segments=[(1, 0, 80), (3, 1, 21), (40, 2, 60)], rows=90, head_dim=16,
                         q_dtype=torch.float16, atol=2e-3),
    "uncovered rows": dict(segments=[(1, 0, 50), (0, 2, 9), (3, 1, 20)], rows=60, gap=3, pad=20, head_dim=16,
                           kv_heads=1, config=SHORT),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_e4m3_attention_matches_the_reference_on_the_same_codes(case):
    check_fp8(**CASES[case])


# The default with q unrounded on e4m3 stores (its prompt chunks round q: tests/test_fp8_qk_long.py).
EXACT_Q = replace(DEFAULT_CONFIG, e4m3_qk_long=False, narrow=replace(DEFAULT_CONFIG.narrow, e4m3_qk_long=False))


@pytest.mark.parametrize("v_magnitude", [1e-3, 2e4])
@pytest.mark.parametrize(
    "config", [EXACT_Q, SdpaConfig(warp_split=4, block_n=64, programs=3)], ids=["tiles", "warp split"]
)
def test_e4m3_attention_keeps_fp16_precision_for_small_and_large_values(config, v_magnitude):
    # a sink-dominated head (every query leans on key 0, whose value is ~0) over V of one magnitude:
    # the other keys' p * v_scale sit far below 1, where fp16 loses bits before it goes subnormal
    segments = [(1, 0, 200), (3, 1, 61), (40, 2, 90)]  # decode, verify (split path), prefill (long path)
    (q, k, v), info = make_case(segments, rows=210, head_dim=32, kv_heads=1, group=2)
    k[0, :3], v[0, :3] = 1.0, v[0, :3] * 1e-3
    (k_codes, k_scale), (v_codes, v_scale) = quantize_fp8(k), quantize_fp8(v * v_magnitude)
    q = (q + 3.0 / 32**0.5).half()
    scales = dict(k_scale=to_scale_layout(k_scale), v_scale=to_scale_layout(v_scale))
    out = sdpa_varlen(q, k_codes, v_codes, info, config=config, **scales)[:44].float()
    ref = sdpa_varlen_reference(q, k_codes, v_codes, info, **scales)[:44].float()
    assert (out - ref).norm() / ref.norm() < 1e-3  # ~3e-4 at any magnitude: fp16's rounding of p and q


LAYOUTS = {  # scale planes [rows, C, Hkv] stored other ways than the store's [C, Hkv, rows]
    "row major": lambda s: s.contiguous(),
    "heads outermost": lambda s: s.permute(2, 0, 1).contiguous().permute(1, 2, 0),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("case", ["mixed split runs", "two heads per program", "prefill long path"])
def test_e4m3_attention_takes_scale_planes_of_any_strides(case, layout):
    check_fp8(**CASES[case], layout=LAYOUTS[layout])


def _fp8_inputs():
    (q, k, v), info = make_case([(1, 0, 4)], rows=8, pad=0, head_dim=16)
    (kc, ks), (vc, vs) = quantize_fp8(k), quantize_fp8(v)
    return dict(q=q, k_store=kc, v_store=vc, seq_info=info, k_scale=to_scale_layout(ks), v_scale=to_scale_layout(vs))


BAD = {
    "e4m3 stores without scales": lambda a: a.update(k_scale=None, v_scale=None),
    "fp16 scales": lambda a: a.update(k_scale=a["k_scale"].half(), v_scale=a["v_scale"].half()),
    "scales of another shape": lambda a: a.update(k_scale=a["k_scale"][:4], v_scale=a["v_scale"][:4]),
    "k and v scales of different strides": lambda a: a.update(v_scale=a["v_scale"].contiguous()),
    "scales beside bf16 stores": lambda a: a.update(k_store=a["k_store"].bfloat16(), v_store=a["v_store"].bfloat16()),
    "e5m2 stores": lambda a: a.update(k_store=a["k_store"].to(torch.float8_e5m2),
                                      v_store=a["v_store"].to(torch.float8_e5m2)),
    "e4m3 queries": lambda a: a.update(q=a["q"].to(FP8)),
    "e4m3 stores of odd strides": lambda a: a.update(  # read as int16 pairs, codes must pair up
        k_store=torch.zeros(8, 6, 2, 17, dtype=FP8)[..., :16], v_store=torch.zeros(8, 6, 2, 17, dtype=FP8)[..., :16]
    ),
}  # fmt: skip


@pytest.mark.parametrize("breach", list(BAD))
def test_e4m3_contract_breaches_raise_contract_error(breach):
    args = _fp8_inputs()
    BAD[breach](args)
    with pytest.raises(ContractError, match="even strides" if "odd" in breach else None):
        sdpa_varlen(**args)


WRITE_BREACHES = ["no scales", "scales for fp32 stores", "fp32 inputs as e5m2 stores", "flat scales",
                  "scales of fewer slots", "k and v scales of different strides"]  # fmt: skip


@pytest.mark.parametrize("breach", WRITE_BREACHES)
def test_the_write_refuses_e4m3_contract_breaches(breach):
    k_flat, v_flat, k_scale, v_scale = poisoned_flat(4, 2, 2, 16)
    args = dict(k_flat=k_flat, v_flat=v_flat, k=torch.randn(2, 2, 16), v=torch.randn(2, 2, 16),
                slots=torch.tensor([1, 2]), k_scale=k_scale, v_scale=v_scale)  # fmt: skip
    if breach == "no scales":
        args.update(k_scale=None)
    elif breach == "flat scales":  # [rows * C, Hkv], as the write took them before scale planes were rows last
        args.update(k_scale=k_scale.reshape(8, 2), v_scale=v_scale.reshape(8, 2))
    elif breach == "scales of fewer slots":
        args.update(k_scale=k_scale[:3], v_scale=v_scale[:3])
    elif breach == "k and v scales of different strides":
        args.update(v_scale=v_scale.contiguous())
    elif breach == "scales for fp32 stores":
        args.update(k_flat=k_flat.float(), v_flat=v_flat.float())
    else:
        args.update(k_flat=k_flat.to(torch.float8_e5m2), v_flat=v_flat.to(torch.float8_e5m2))
    planes = breach in ("no scales", "flat scales", "scales of fewer slots")  # the message names the planes' shape
    with pytest.raises(ContractError, match=r"\[rows, C, 2\] with rows \* C = 8 " if planes else None):
        kv_write(**{name: x.to(DEVICE) if isinstance(x, torch.Tensor) else x for name, x in args.items()})
