"""The fused layer kernels (Triton, under the interpreter on CPU) against their torch versions."""

from __future__ import annotations

import pytest
import torch

from batchkv.models import fused
from batchkv.models.fused import add_rms_norm, qk_norm_rope, silu_mul
from batchkv.models.sensenova import Rope3D

pytest.importorskip("triton")


@pytest.mark.parametrize("width", [1, 5])
def test_add_rms_norm_kernel_matches_torch(width):
    g = torch.Generator().manual_seed(width)
    h, delta = torch.randn(width, 96, generator=g), torch.randn(width, 96, generator=g)
    weight = torch.randn(96, generator=g)
    want = add_rms_norm(h, delta, weight, 1e-6, triton_kernel=False)
    got = add_rms_norm(h, delta, weight, 1e-6, triton_kernel=True)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


# (20, 4, 64): 24 heads in two programs of 16, the second ragged and holding both q and k heads.
@pytest.mark.parametrize(("q_heads", "kv_heads", "d"), [(4, 2, 32), (3, 1, 64), (20, 4, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("blocks", [False, True])  # one head per program; blocks of heads (many rows)
def test_qk_norm_rope_kernel_matches_torch(q_heads, kv_heads, d, dtype, blocks, monkeypatch):
    width = 3
    assert width * (q_heads + kv_heads) <= fused.QK_FEW_PROGRAMS
    if blocks:  # as past QK_FEW_PROGRAMS (row, head) pairs, at a size the interpreter runs in seconds
        monkeypatch.setattr(fused, "QK_FEW_PROGRAMS", 0)
    g = torch.Generator().manual_seed(d)
    qkv = (torch.randn(width, (q_heads + 2 * kv_heads) * d, generator=g) * 3).to(dtype)
    q_norm, k_norm = (torch.randn(2, d // 2, generator=g).to(dtype) for _ in range(2))
    rope = Rope3D(d, 5e6, 1e4)
    indexes = torch.tensor([[7, 300, 2], [0, 4, 9], [0, 1, 5]])  # [3, W]: t, h, w per row
    cos, sin = rope.tables(indexes, dtype)  # the model's tables are in its dtype
    want = qk_norm_rope(qkv, q_norm, k_norm, cos, sin, rope.partner, q_heads, kv_heads, 1e-6, triton_kernel=False)
    got = qk_norm_rope(qkv, q_norm, k_norm, cos, sin, rope.partner, q_heads, kv_heads, 1e-6, triton_kernel=True)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype == dtype
        if dtype == torch.bfloat16:  # both round at the same points; torch's CPU ops round inside: 4 ulp
            torch.testing.assert_close(a, b, rtol=4 * 2**-8, atol=4 * 2**-8 * b.abs().max().item())
        else:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_silu_mul_kernel_matches_torch():
    g = torch.Generator().manual_seed(0)
    gate_up = torch.randn(3, 2 * 1500, generator=g)  # not a block multiple
    torch.testing.assert_close(silu_mul(gate_up, triton_kernel=True), silu_mul(gate_up, triton_kernel=False))
