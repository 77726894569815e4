"""kv_write (Triton) against kv_write_reference: scattered slots, strided inputs, casting, refusals."""

from __future__ import annotations

import pytest
import torch

from batchkv.errors import ContractError
from batchkv.ops import kv_write_reference, sdpa_varlen_reference
from batchkv.ops.kv_write_triton import kv_write

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def stores(dtype, slots=150, kv_heads=3, head_dim=16):
    k = torch.full((slots, kv_heads, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    return k, k.clone()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kv_write_puts_each_row_at_its_slot_like_the_reference(dtype):
    gen = torch.Generator().manual_seed(1)
    width, kv_heads, head_dim = 7, 3, 16
    # k and v as strided views of one fused projection, as a model hands them over.
    kv = torch.randn(width, 2, kv_heads, head_dim, generator=gen).to(DEVICE)
    k, v = kv[:, 0], kv[:, 1]
    slots = torch.randperm(150, generator=gen)[:width].to(DEVICE)
    k_flat, v_flat = stores(dtype)
    k_ref, v_ref = stores(dtype)
    kv_write(k_flat, v_flat, k, v, slots)
    kv_write_reference(k_ref, v_ref, k, v, slots)
    torch.testing.assert_close(k_flat, k_ref, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_flat, v_ref, rtol=0, atol=0, equal_nan=True)
    assert k_flat.isnan().any(dim=(1, 2)).sum() == 150 - width  # nothing else was touched


def test_kv_write_accepts_int32_slots():
    k_flat, v_flat = stores(torch.float32)
    k = torch.randn(2, 3, 16, device=DEVICE)
    kv_write(k_flat, v_flat, k, -k, torch.tensor([5, 9], dtype=torch.int32, device=DEVICE))
    assert torch.equal(k_flat[[5, 9]], k) and torch.equal(v_flat[[5, 9]], -k)


BAD = {
    "slots of the wrong length": lambda a: a.update(slots=a["slots"][:1]),
    "float slots": lambda a: a.update(slots=a["slots"].float()),
    "head count differs": lambda a: a.update(k=a["k"][:, :2], v=a["v"][:, :2]),
    "k and v shapes differ": lambda a: a.update(v=a["v"][:1]),
    "stores of different dtypes": lambda a: a.update(v_flat=a["v_flat"].half()),
    "int v": lambda a: a.update(v=a["v"].int()),
    "float64 v": lambda a: a.update(v=a["v"].double()),
    "strided last dim": lambda a: a.update(k=a["k"].transpose(1, 2).contiguous().transpose(1, 2)),
}


@pytest.mark.parametrize("breach", list(BAD))
def test_kv_write_refuses_contract_breaches(breach):
    k_flat, v_flat = stores(torch.float32)
    args = dict(k_flat=k_flat, v_flat=v_flat, k=torch.randn(2, 3, 16), v=torch.randn(2, 3, 16))
    args = {name: x.to(DEVICE) for name, x in args.items()} | {"slots": torch.tensor([1, 2], device=DEVICE)}
    BAD[breach](args)
    with pytest.raises(ContractError):
        kv_write(**args)


def test_the_package_exports_the_kernel_functions_not_their_modules():
    from batchkv.ops import kv_write as write
    from batchkv.ops import sdpa_varlen as attend

    assert callable(write) and callable(attend)
    k_flat, v_flat = torch.zeros(8, 1, 16, device=DEVICE), torch.zeros(8, 1, 16, device=DEVICE)
    k, v = torch.randn(2, 1, 16, device=DEVICE), torch.randn(2, 1, 16, device=DEVICE)
    write(k_flat, v_flat, k, v, torch.tensor([3, 5], device=DEVICE))
    assert torch.equal(k_flat[[3, 5]], k) and torch.equal(v_flat[[3, 5]], v)
    store_k, store_v = k_flat.view(8, 1, 1, 16), v_flat.view(8, 1, 1, 16)
    info = torch.tensor([[0, 1, 0, 6]], dtype=torch.int32, device=DEVICE)
    q = torch.randn(1, 2, 16, device=DEVICE)
    out = attend(q, store_k, store_v, info)
    assert torch.allclose(out, sdpa_varlen_reference(q, store_k, store_v, info), atol=1e-5)
