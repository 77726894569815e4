"""sdpa_varlen and kv_write on the GPU: SenseNova shapes, bf16, and replay of one captured graph.

Run on the H200: `python3 -m pytest -m gpu tests/test_sdpa_varlen_gpu.py -q`.
"""

from __future__ import annotations

import pytest
import torch

from batchkv.ops import kv_write_reference, sdpa_varlen_reference

pytestmark = pytest.mark.gpu

COLUMNS = 65  # 64 sequences + scratch


def poisoned_store(rows, kv_heads, head_dim, dtype, lengths, cols, gen):
    """[rows, 65, Hkv, D] K and V: random over each column's resident history, NaN everywhere else."""
    k = torch.full((rows, COLUMNS, kv_heads, head_dim), float("nan"), dtype=dtype, device="cuda")
    v = torch.full_like(k, float("nan"))
    for col, end in zip(cols, lengths, strict=True):
        t = torch.arange(max(0, end - rows), end, device="cuda") % rows
        k[t, col] = torch.randn(len(t), kv_heads, head_dim, generator=gen, device="cuda").to(dtype)
        v[t, col] = torch.randn(len(t), kv_heads, head_dim, generator=gen, device="cuda").to(dtype)
    return k, v


def table(q_lens, kv_ends, cols, num_segments):
    info = torch.zeros(num_segments, 4, dtype=torch.int32)
    q_start = 0
    for s, (q_len, kv_end, col) in enumerate(zip(q_lens, kv_ends, cols, strict=True)):
        info[s] = torch.tensor([q_start, q_len, col, kv_end])
        q_start += q_len
    return info.cuda(), q_start


def run_case(q_lens, kv_ends, *, rows, kv_heads=8, group=4, head_dim=128, dtype=torch.bfloat16, causal=True,
             window=0, pad=3, seed=0, atol=2e-2, config=None):  # fmt: skip
    from batchkv.ops.sdpa.launch import _counters, sdpa_varlen

    gen = torch.Generator(device="cuda").manual_seed(seed)
    cols = torch.randperm(64, generator=torch.Generator().manual_seed(seed))[: len(q_lens)].tolist()
    k, v = poisoned_store(rows, kv_heads, head_dim, dtype, kv_ends, cols, gen)
    info, width = table(q_lens, kv_ends, cols, 2 * len(q_lens))
    q = torch.randn(width + pad, kv_heads * group, head_dim, generator=gen, device="cuda").to(dtype)
    out = torch.full_like(q, float("nan"))
    sdpa_varlen(q, k, v, info, causal=causal, window=window, out=out, config=config)
    ref = sdpa_varlen_reference(q, k, v, info, causal=causal, window=window)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=atol)
    assert torch.equal(out[width:], torch.zeros_like(out[width:]))
    assert not _counters(q.device, 0).any()  # every launch leaves the merge counters at zero


def test_sensenova_decode_batch_matches_reference():
    lengths = torch.randint(64, 8193, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    run_case([1] * 64, lengths, rows=8192)


def test_sensenova_mixed_decode_verify_and_prefill_match_reference():
    run_case([1, 4, 16, 1, 300, 17, 4], [9100, 4, 2000, 1, 700, 4000, 129], rows=9216)


def test_sensenova_sliding_window_over_a_wrapped_ring_matches_reference():
    run_case([1, 4, 1, 100], [5000, 20000, 30, 3000], rows=1100, window=1024)


def test_sensenova_non_causal_draft_blocks_match_reference():
    run_case([4, 16, 1], [300, 5000, 77], rows=8192, causal=False)


@pytest.mark.parametrize(("head_dim", "dtype"), [(64, torch.bfloat16), (256, torch.bfloat16), (128, torch.float16)])
def test_other_head_dims_and_fp16_match_reference(head_dim, dtype):
    run_case([1, 3, 1, 64], [1000, 3000, 7, 500], rows=4096, head_dim=head_dim, dtype=dtype)


def test_every_swept_config_matches_reference():
    from batchkv.ops.sdpa.launch import SdpaConfig

    sweep = [{"heads": 1}, {"heads": 2, "occupancy": 4}, {"heads": 4}, {"heads": 8, "occupancy": 1},
             {"min_blocks": 4}, {"occupancy": 3}, {"skip_masks": False},
             {"block_m_long": 64, "num_warps_long": 4, "num_stages_long": 2}, {"tma_long": True},
             {"tma_long": True, "block_m_long": 64, "block_n_long": 128, "num_warps_long": 4,
              "num_stages_long": 2}]  # fmt: skip
    for overrides in sweep:
        run_case([1, 4, 16, 1, 300, 1, 2], [4000, 4, 2000, 1, 700, 64, 3000], rows=4096, config=SdpaConfig(**overrides))


def test_one_sequence_decode_merges_many_programs_and_matches_reference():
    for length in (17, 1024, 4096):
        run_case([1], [length], rows=4096, pad=0)


def test_fp32_storage_matches_reference_tightly():
    run_case([1, 5, 40], [999, 333, 200], rows=1024, dtype=torch.float32, kv_heads=2, atol=1e-4)


def test_one_captured_graph_replays_three_length_mixes_with_the_kv_write():
    from batchkv.ops.kv_write_triton import kv_write
    from batchkv.ops.sdpa.launch import _counters, sdpa_varlen

    rows, kv_heads, head_dim, width = 4096, 8, 128, 24
    gen = torch.Generator(device="cuda").manual_seed(3)
    shape = (rows, COLUMNS, kv_heads, head_dim)
    k_store = torch.randn(shape, generator=gen, device="cuda").to(torch.bfloat16)
    v_store = torch.randn(shape, generator=gen, device="cuda").to(torch.bfloat16)
    k_flat, v_flat = k_store.view(-1, kv_heads, head_dim), v_store.view(-1, kv_heads, head_dim)
    q = torch.zeros(width, 32, head_dim, dtype=torch.bfloat16, device="cuda")
    k_new, v_new = torch.zeros(2, width, kv_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    slots = torch.zeros(width, dtype=torch.int64, device="cuda")
    info = torch.zeros(16, 4, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)

    def step():
        kv_write(k_flat, v_flat, k_new, v_new, slots)
        sdpa_varlen(q, k_store, v_store, info, out=out)

    mixes = [  # (q_len, col, kv_end) per segment
        [(1, 5, 4000), (1, 9, 17), (4, 2, 900)],
        [(16, 9, 33), (1, 40, 1), (1, 63, 4096), (1, 0, 2500), (4, 5, 4004)],
        [(1, 7, 64)],
        [(1, 7, 4096)],  # one long sequence: every program merges into one item
    ]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for mix in mixes:
        host_info = torch.zeros(16, 4, dtype=torch.int32)
        host_slots = torch.arange(width) * COLUMNS + 64  # padding -> scratch column
        q_start = 0
        for s, (q_len, col, kv_end) in enumerate(mix):
            host_info[s] = torch.tensor([q_start, q_len, col, kv_end])
            pos = torch.arange(kv_end - q_len, kv_end)
            host_slots[q_start : q_start + q_len] = (pos % rows) * COLUMNS + col
            q_start += q_len
        info.copy_(host_info)
        slots.copy_(host_slots)
        for x in (q, k_new, v_new):
            x.copy_(torch.randn(x.shape, generator=gen, device="cuda"))
        expect_k, expect_v = k_flat.clone(), v_flat.clone()
        kv_write_reference(expect_k, expect_v, k_new, v_new, slots)
        graph.replay()
        torch.cuda.synchronize()
        assert not _counters(q.device, 0).any()  # the merge counters clean up after every replay
        assert torch.equal(k_flat, expect_k) and torch.equal(v_flat, expect_v)
        ref = sdpa_varlen_reference(q, k_store, v_store, info)
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
        assert torch.equal(out[q_start:], torch.zeros_like(out[q_start:]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_tma_prompt_chunks_equal_pointer_loads_exactly_and_replay_in_a_graph(dtype):
    # SdpaConfig.tma_long reads the same tiles through host descriptors: outputs bit for bit equal,
    # also from a captured graph replayed after the table changes (the descriptors hold store addresses)
    from batchkv.ops.reference import quantize_fp8
    from batchkv.ops.sdpa.launch import SdpaConfig, sdpa_varlen
    from batchkv.ops.support import to_scale_layout

    gen = torch.Generator(device="cuda").manual_seed(5)
    lengths, q_lens = [1536, 2048, 700, 4000], [512, 1024, 1, 300]
    k, v = poisoned_store(4096, 8, 128, torch.bfloat16, lengths, [3, 9, 20, 41], gen)
    scales = {}
    if dtype != torch.bfloat16:
        (k, ks), (v, vs) = quantize_fp8(k.nan_to_num(0.0)), quantize_fp8(v.nan_to_num(0.0))
        scales = dict(k_scale=to_scale_layout(ks), v_scale=to_scale_layout(vs))
    info, width = table(q_lens, lengths, [3, 9, 20, 41], 8)
    q = torch.randn(width, 32, 128, generator=gen, device="cuda").to(torch.bfloat16)
    outs = {tma: torch.empty_like(q) for tma in (True, False)}

    def step():
        for tma, out in outs.items():
            sdpa_varlen(q, k, v, info, out=out, config=SdpaConfig(tma_long=tma, e4m3_qk_long=True), **scales)

    step()
    assert torch.equal(outs[True], outs[False]) and not outs[True].isnan().any()
    ref = sdpa_varlen_reference(q, k, v, info, **scales).float()
    if dtype == torch.bfloat16:  # e4m3 rounds the prompt rows' queries (tests/test_fp8_qk_long.py bounds it)
        torch.testing.assert_close(outs[True].float(), ref, atol=2e-2, rtol=2e-2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    info.copy_(table([256, 1, 64, 300], [3000, 90, 64, 700], [41, 3, 9, 20], 8)[0])  # within each resident history
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(outs[True], outs[False])
    eager = torch.empty_like(q)
    sdpa_varlen(q, k, v, info, out=eager, config=SdpaConfig(tma_long=True, e4m3_qk_long=True), **scales)
    assert torch.equal(eager, outs[True])
