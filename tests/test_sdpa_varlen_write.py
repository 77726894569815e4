"""sdpa_varlen's `write` (the step's K/V rows stored first) against kv_write_reference then the
reference attention: on the main path, on split_merge with a kv_write launch, and with the write
fused into split_merge's partials kernel (`SdpaConfig.fuse_write`); fp32 and e4m3 stores; the new
rows' slots NaN-poisoned before the call, so attending before writing shows; a padding row written
to the scratch column; the stores after the call equal the reference's bit for bit."""

from __future__ import annotations

import pytest
import torch

from batchkv.errors import ContractError
from batchkv.ops import kv_write_reference, sdpa_varlen_reference
from batchkv.ops.reference import quantize_fp8
from batchkv.ops.sdpa.launch import SdpaConfig, sdpa_varlen

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FUSED = SdpaConfig(split_merge=True, fuse_write=True, block_n=16, programs=5)
FUSED_FULL = SdpaConfig(split_merge=True, fuse_write=True)  # the sizes a GPU resolves
CONFIGS = {
    "default": None,
    "main path": SdpaConfig(block_n=16),
    "split_merge, kv_write launch": SdpaConfig(split_merge=True, block_n=16, programs=5),
    "split_merge, fused write": FUSED,
}


def step_case(segments, *, rows, columns=4, kv_heads=2, group=2, head_dim=16, e4m3=False, seed=0):
    """Stores [rows, C, Hkv, D] holding each column's history before this step and NaN elsewhere
    (the last column is the scratch), the step's seq_info, q, and write = (k, v, slots) with one
    padding row aimed at the scratch column. Segments are (q_len, col, kv_end)."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.full((rows, columns, kv_heads, head_dim), float("nan"))
    v = torch.full_like(k, float("nan"))
    table, slots, q_start = [], [], 0
    for q_len, col, kv_end in segments:
        for t in range(max(0, kv_end - rows), kv_end - q_len):  # the history; new rows stay NaN
            k[t % rows, col], v[t % rows, col] = torch.randn(2, kv_heads, head_dim, generator=gen)
        table.append((q_start, q_len, col, kv_end))
        slots += [(t % rows) * columns + col for t in range(kv_end - q_len, kv_end)]
        q_start += q_len
    slots.append(columns - 1)  # the padding row: row 0 of the scratch column
    width = len(slots)
    q = torch.randn(width, kv_heads * group, head_dim, generator=gen).to(DEVICE)
    new_k, new_v = torch.randn(2, width, kv_heads, head_dim, generator=gen).to(DEVICE)
    planes = {}
    if e4m3:
        for name, x in (("k", k), ("v", v)):
            codes, scales = quantize_fp8(torch.nan_to_num(x, nan=0.0))
            codes.view(torch.uint8)[x.isnan()] = 0x7F  # never-written rows hold NaN codes and scales
            scales[x.isnan().any(-1)] = float("nan")
            planes[name], planes[f"{name}_scale"] = codes.to(DEVICE), scales.to(DEVICE)
    else:
        planes = {"k": k.to(DEVICE), "v": v.to(DEVICE)}
    info = torch.tensor(table, dtype=torch.int32).to(DEVICE)
    return q, planes, info, (new_k, new_v, torch.tensor(slots, device=DEVICE))


def run_both(segments, config, poison=None, **case):
    """(out, planes after) of sdpa_varlen with `write`, and of kv_write_reference then the reference;
    `poison(write)` may change the step's (k, v, slots) first."""
    q, planes, info, write = step_case(segments, **case)
    write = poison(write) if poison else write
    ref_planes = {name: t.clone() for name, t in planes.items()}
    scales = {name: planes[name] for name in ("k_scale", "v_scale") if name in planes}
    out = sdpa_varlen(q, planes["k"], planes["v"], info, config=config, write=write, **scales)
    ref_scales = {name: ref_planes[name] for name in scales}
    ks, vs = (ref_planes[n].view(-1, *ref_planes[n].shape[2:]) for n in ("k", "v"))
    kv_write_reference(ks, vs, *write, ref_scales.get("k_scale"), ref_scales.get("v_scale"))
    ref = sdpa_varlen_reference(q, ref_planes["k"], ref_planes["v"], info, **ref_scales)
    return (out, planes), (ref, ref_planes)


STEPS = {
    "two decoding sequences": [(1, 0, 40), (1, 1, 7)],
    "one verify block": [(4, 0, 37)],
    "a wrapped ring": [(1, 0, 70), (2, 2, 51)],  # 24 rows: positions wrap
}


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("segments", STEPS.values(), ids=STEPS.keys())
def test_written_rows_are_attended_and_stored_like_the_reference(segments, config):
    (out, planes), (ref, ref_planes) = run_both(segments, config, rows=24 if max(e for *_, e in segments) > 48 else 48)
    assert not out[:-1].isnan().any()
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    for name in planes:
        torch.testing.assert_close(planes[name], ref_planes[name], rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("config", [CONFIGS["main path"], FUSED], ids=["main path", "fused write"])
def test_e4m3_stores_get_the_reference_codes_and_scales(config):
    (out, planes), (ref, ref_planes) = run_both([(1, 0, 40), (2, 1, 9)], config, rows=48, e4m3=True)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    for name in planes:  # codes compared as bytes, scales with their NaNs
        got, want = (t[name].view(torch.uint8) if name in ("k", "v") else t[name] for t in (planes, ref_planes))
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def test_the_reference_writes_first_too():
    q, planes, info, write = step_case([(1, 0, 30)], rows=32)
    out = sdpa_varlen_reference(q, planes["k"], planes["v"], info, write=write)
    assert not out[:-1].isnan().any()  # the new row was NaN before the write


def test_a_write_breaking_kv_writes_contract_is_refused_before_anything_is_written():
    q, planes, info, (k, v, slots) = step_case([(1, 0, 30)], rows=32)
    before = planes["k"].clone()
    with pytest.raises(ContractError, match="slots"):
        sdpa_varlen(q, planes["k"], planes["v"], info, config=FUSED, write=(k, v, slots[:-1]))
    torch.testing.assert_close(planes["k"], before, rtol=0, atol=0, equal_nan=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the GPU machine)")
@pytest.mark.parametrize("q_len", [1, 16])
def test_a_captured_fused_write_replays_each_step_like_write_then_attend_on_the_h200_shape(q_len):
    # One sequence over the single-sequence cache's 2-row table, as decode (1 token) and a verify block (16)
    rows, kv_heads, head_dim = 16384, 8, 128
    gen = torch.Generator(device="cuda").manual_seed(7)
    k, v = (torch.randn(rows, 2, kv_heads, head_dim, generator=gen, device="cuda").to(torch.bfloat16) for _ in "kv")
    k[:, 1], v[:, 1] = float("nan"), float("nan")  # the scratch column: written by the padding row only
    q = torch.randn(q_len, 32, head_dim, generator=gen, device="cuda").to(torch.bfloat16)
    new_k, new_v = (torch.randn(q_len, kv_heads, head_dim, generator=gen, device="cuda").to(torch.bfloat16)
                    for _ in "kv")  # fmt: skip
    info = torch.tensor([[0, q_len, 0, 0], [0, 0, 1, 0]], dtype=torch.int32, device="cuda")
    slots = torch.zeros(q_len, dtype=torch.int64, device="cuda")
    out = torch.empty_like(q)

    def set_end(end):
        info[0, 3] = end
        slots.copy_((torch.arange(end - q_len, end, device="cuda") % rows) * 2)

    set_end(100)
    sdpa_varlen(q, k, v, info, out=out, config=FUSED_FULL, write=(new_k, new_v, slots))  # compile outside
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sdpa_varlen(q, k, v, info, out=out, config=FUSED_FULL, write=(new_k, new_v, slots))
    for end in (16, 1024, 9100, 16384, 20000):  # 20,000 wraps the ring
        set_end(end)
        k[slots // 2, 0], v[slots // 2, 0] = float("nan"), float("nan")  # stale rows: attended only if unwritten
        graph.replay()
        written = (k[slots // 2, 0].clone(), v[slots // 2, 0].clone())
        assert torch.equal(written[0], new_k) and torch.equal(written[1], new_v)
        ref = sdpa_varlen_reference(q, k, v, info)
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_the_reference_takes_int32_slots_as_kv_write_does():
    q, planes, info, (k, v, slots) = step_case([(1, 0, 30)], rows=32)
    out = sdpa_varlen_reference(q, planes["k"], planes["v"], info, write=(k, v, slots.int()))
    torch.testing.assert_close(out, sdpa_varlen(q, planes["k"], planes["v"], info, write=(k, v, slots.int())))


def test_a_write_wider_than_the_step_takes_the_kv_write_launch_even_with_fuse_write():
    q, planes, info, (k, v, slots) = step_case([(1, 0, 30)], rows=32)
    extra = torch.tensor([7, 11], device=DEVICE)  # two more rows, to the scratch column (3 of 4)
    wide = (torch.cat([k, k[:2]]), torch.cat([v, v[:2]]), torch.cat([slots, extra]))
    ref_planes = {name: t.clone() for name, t in planes.items()}
    out = sdpa_varlen(q, planes["k"], planes["v"], info, config=FUSED, write=wide)
    ref = sdpa_varlen_reference(q, ref_planes["k"], ref_planes["v"], info, write=wide)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(planes["k"], ref_planes["k"], rtol=0, atol=0, equal_nan=True)
