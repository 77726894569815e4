"""e4m3 stores of K/V rows holding a NaN or an infinity: the reference, the Triton write and the write
fused into split_merge store a NaN scale and every code 0x7F for such a row, bit for bit alike, so it
reads back NaN and never a finite value; the row's other heads and the other rows keep their codes."""

from __future__ import annotations

import pytest
import torch

from batchkv.ops.kv_write_triton import kv_write
from batchkv.ops.reference import dequantize_fp8, kv_write_reference, quantize_fp8
from tests.test_fp8_kernels import DEVICE, bits, poisoned_flat
from tests.test_sdpa_varlen_write import CONFIGS, FUSED, run_both

NAN = float("nan")
BAD_VALUES = {"NaN": NAN, "negative NaN": -NAN, "inf": float("inf"), "-inf": -float("inf")}


def rows_with(value: float, *, width: int = 4, kv_heads: int = 3, head_dim: int = 16, seed: int = 0) -> torch.Tensor:
    """Random rows [width, Hkv, D] with `value` at one element of (token 1, head 2) and (token 3, head 0)."""
    x = torch.randn(width, kv_heads, head_dim, generator=torch.Generator().manual_seed(seed))
    x[1, 2, 5], x[3, 0, 0] = value, value
    return x


@pytest.mark.parametrize("value", BAD_VALUES.values(), ids=BAD_VALUES.keys())
def test_quantize_fp8_stores_a_nonfinite_row_as_nan_codes_and_a_nan_scale(value):
    x = rows_with(value)
    codes, scale = quantize_fp8(x)
    bad = torch.zeros(4, 3, dtype=torch.bool)
    bad[1, 2] = bad[3, 0] = True
    assert torch.equal(scale.isnan(), bad)
    assert bits(codes)[bad].eq(0x7F).all()  # sign bit clear whatever the NaN's or infinity's sign
    assert dequantize_fp8(codes, scale)[bad].isnan().all()
    finite_codes, finite_scale = quantize_fp8(torch.where(bad[..., None], 0.0, x))
    assert torch.equal(bits(codes)[~bad], bits(finite_codes)[~bad])  # the other rows are untouched by it
    assert torch.equal(scale[~bad], finite_scale[~bad])


@pytest.mark.parametrize("value", BAD_VALUES.values(), ids=BAD_VALUES.keys())
def test_the_triton_write_stores_nonfinite_rows_as_the_reference_does_bit_for_bit(value):
    k, v = rows_with(value).to(DEVICE), rows_with(value, seed=1).flip(0).to(DEVICE)  # v's bad rows: (2, 2), (0, 0)
    slots = torch.tensor([9, 2, 14, 5], device=DEVICE)  # 8 rows of 2 columns
    got, want = poisoned_flat(8, 2, 3, 16), poisoned_flat(8, 2, 3, 16)
    for codes_k, codes_v, scale_k, scale_v in (got, want):  # start finite: a skipped write cannot pass for NaN
        codes_k.view(torch.uint8).zero_(), codes_v.view(torch.uint8).zero_(), scale_k.fill_(1.0), scale_v.fill_(1.0)
    kv_write(got[0], got[1], k, v, slots, k_scale=got[2], v_scale=got[3])
    kv_write_reference(want[0], want[1], k, v, slots, k_scale=want[2], v_scale=want[3])
    for g, w in zip(got, want, strict=True):
        assert torch.equal(bits(g), bits(w))
    assert bits(got[0])[2, 2].eq(0x7F).all() and got[2][1, 0, 2].isnan()  # k's (token 1, head 2) at slot 2
    assert bits(got[1])[9, 0].eq(0x7F).all() and got[3][4, 1, 0].isnan()  # v's (token 0, head 0) at slot 9
    assert got[2].isnan().sum() == 2 and got[3].isnan().sum() == 2  # one NaN scale per bad row, no more


WRITES = {"kv_write launch": CONFIGS["main path"], "fused write": FUSED}


def poisoned(k_at=None, v_at=None, value=NAN):
    """A `run_both` poison: `value` into the step's new K at index k_at and new V at v_at ([token, head, d])."""

    def poison(write):
        new_k, new_v, slots = write
        if k_at:
            new_k[k_at] = value
        if v_at:
            new_v[v_at] = value
        return new_k, new_v, slots

    return poison


@pytest.mark.parametrize("config", WRITES.values(), ids=WRITES.keys())
def test_sdpa_varlens_write_stores_nonfinite_rows_as_the_reference_does_bit_for_bit(config):
    poison = poisoned(k_at=(0, 1, 5), v_at=(2, 0, 7), value=-NAN)  # sequence 0's K (head 1), sequence 1's V (head 0)
    (_, planes), (_, ref_planes) = run_both([(1, 0, 40), (2, 1, 9)], config, rows=48, e4m3=True, poison=poison)
    for name in planes:  # codes compared as bytes, scales with their NaNs
        got, want = (t[name].view(torch.uint8) if name in ("k", "v") else t[name] for t in (planes, ref_planes))
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert bits(planes["k"])[39, 0, 1].eq(0x7F).all() and planes["k_scale"][39, 0, 1].isnan()  # position 39, col 0
    assert bits(planes["v"])[8, 1, 0].eq(0x7F).all() and planes["v_scale"][8, 1, 0].isnan()  # position 8, col 1


@pytest.mark.parametrize("value", [NAN, -float("inf")], ids=["NaN", "-inf"])
@pytest.mark.parametrize("config", WRITES.values(), ids=WRITES.keys())
def test_attention_over_a_written_nonfinite_v_row_gives_nan_not_a_finite_value(config, value):
    poison = poisoned(v_at=(2, 0, 7), value=value)  # sequence 1's second token, KV head 0 (query heads 0 and 1)
    (out, _), (ref, _) = run_both([(1, 0, 40), (2, 1, 9)], config, rows=48, e4m3=True, poison=poison)
    nan = torch.zeros(4, 4, dtype=torch.bool, device=out.device)  # [token, query head]; token 3 is the padding row
    nan[1:3, :2] = True  # both of sequence 1's queries: the earlier one's masked p = 0 times NaN too, as in bf16
    assert torch.equal(out.isnan().any(-1), nan) and torch.equal(ref.isnan().any(-1), nan)
    torch.testing.assert_close(out[~nan], ref[~nan], atol=2e-5, rtol=1e-4)
