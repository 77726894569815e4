"""The split path's few-row variants (SdpaConfig.warp_split, .prefetch, .merge_stages) against the reference.

Each variant runs the contract's awkward cases under the interpreter on NaN-poisoned stores: GQA,
decode, verify and prefill segments in one table, a window over a wrapped ring, non-causal draft
blocks, uncovered rows, items shared by several programs (merged) and e4m3 storage. Under the
interpreter `prefetch` loads the rows it would prefetch and folds 0 * row into q, so a prefetch of
a row outside the resident keys turns the output into NaN.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from batchkv.errors import ContractError
from batchkv.ops import sdpa_varlen_reference
from batchkv.ops.reference import quantize_fp8
from batchkv.ops.sdpa.common import prefetch_keys
from batchkv.ops.sdpa.launch import SdpaConfig, resolve_config, sdpa_varlen
from batchkv.ops.support import sm_count, to_scale_layout
from tests.test_sdpa_varlen import check, make_case

VARIANTS = {
    "warp_split 4": SdpaConfig(warp_split=4, block_n=64, programs=3),
    "warp_split 2, prefetch 1": SdpaConfig(warp_split=2, block_n=32, prefetch=1, programs=2),
    "prefetch 1": SdpaConfig(prefetch=1, block_n=32, programs=3),
    "prefetch 3, 2 heads": SdpaConfig(prefetch=3, heads=2, block_n=16, programs=4),
    "merge in 2 stages": SdpaConfig(merge_stages=2, merge_tile=2 * 4 * 16, block_n=16, programs=7),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_mixed_table_over_a_windowed_ring_matches_reference(variant):
    # decode, verify and prefill segments (one sequence in two runs), a gap before each, padding after;
    # rows = window + max_write - 1 for window 24 and 17-token writes, so the long histories wrap
    segments = [(1, 3, 200), (4, 0, 63), (0, 4, 0), (17, 1, 40), (2, 0, 65), (1, 2, 1), (16, 5, 90)]
    check(segments, rows=40, window=24, group=4, kv_heads=2, head_dim=16, gap=1, config=VARIANTS[variant])


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_non_causal_draft_blocks_and_long_decodes_match_reference(variant):
    segments = [(4, 0, 70), (16, 1, 33), (1, 2, 97), (1, 3, 9), (3, 4, 65)]
    check(segments, rows=100, causal=False, group=2, kv_heads=2, head_dim=16, config=VARIANTS[variant])


@pytest.mark.parametrize("head_dim", [16, 32])  # 16: K re-interleaved for one dot; 32: dots over code pairs
@pytest.mark.parametrize("variant", ["warp_split 4", "warp_split 2, prefetch 1", "prefetch 1"])
def test_e4m3_stores_match_reference_on_their_codes(variant, head_dim):
    (q, k, v), info = make_case([(1, 0, 200), (3, 1, 57), (1, 2, 5)], rows=210, head_dim=head_dim, kv_heads=2)
    (k_codes, k_scale), (v_codes, v_scale) = quantize_fp8(k), quantize_fp8(v)
    scales = dict(k_scale=to_scale_layout(k_scale), v_scale=to_scale_layout(v_scale))
    out = torch.full_like(q, float("nan"))
    sdpa_varlen(q, k_codes, v_codes, info, config=VARIANTS[variant], out=out, **scales)
    ref = sdpa_varlen_reference(q, k_codes, v_codes, info, **scales)
    torch.testing.assert_close(out[:5], ref[:5], atol=2e-5, rtol=1e-4)
    assert torch.equal(out[5:], torch.zeros_like(out[5:]))


@triton.jit
def _prefetch_probe(k, v, out, rows, a, b, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    tl.store(out, prefetch_keys(k, v, HEAD_DIM, 0, rows, 0, a, b, BLOCK_N, 1, HEAD_DIM, 8, True))


def test_the_interpreter_prefetch_turns_a_row_outside_the_resident_keys_into_nan():
    # The check behind the tests above: rows [0, 20) resident, NaN from 20 on.
    k = torch.randn(32, 16)
    k[20:] = float("nan")
    out = torch.full((1,), 7.0)
    _prefetch_probe[(1,)](k, k.clone(), out, 32, 4, 20, BLOCK_N=16, HEAD_DIM=16)
    assert out.item() == 0.0  # keys 4..19: all resident
    _prefetch_probe[(1,)](k, k.clone(), out, 32, 8, 21, BLOCK_N=16, HEAD_DIM=16)
    assert out.isnan().all()  # key 20 is not


def test_a_narrow_config_serves_steps_up_to_its_width_and_the_outer_one_the_rest():
    # An invalid narrow config shows which config a step took: only steps of T <= 3 take it.
    config = SdpaConfig(block_n=16, narrow=SdpaConfig(warp_split=3), narrow_width=3)
    check([(1, 0, 40), (1, 1, 7)], rows=64, head_dim=16, kv_heads=2, pad=2, config=config)  # T = 4: the outer one
    (q, k, v), info = make_case([(1, 0, 40), (1, 1, 7)], rows=64, head_dim=16, kv_heads=2, pad=1)  # T = 3
    with pytest.raises(ContractError):
        sdpa_varlen(q, k, v, info, config=config)
    config = SdpaConfig(narrow=SdpaConfig(warp_split=2, block_n=32, prefetch=1, programs=3), narrow_width=3)
    check([(1, 0, 90), (1, 1, 7)], rows=100, head_dim=16, kv_heads=2, pad=1, config=config)


def test_a_narrow_config_also_serves_tables_of_at_most_narrow_segments_rows():
    # the invalid narrow config again: a 2-row table takes it at any width, a 3-row one does not
    config = SdpaConfig(block_n=16, narrow=SdpaConfig(warp_split=3), narrow_segments=2)
    (q, k, v), info = make_case([(5, 0, 40), (1, 1, 7)], rows=64, head_dim=16, kv_heads=2, pad=1)
    with pytest.raises(ContractError):
        sdpa_varlen(q, k, v, info, config=config)
    check([(5, 0, 40), (1, 1, 7), (0, 2, 0)], rows=64, head_dim=16, kv_heads=2, pad=1, config=config)


def test_warp_split_widens_the_default_key_tile_to_16_keys_per_warp():
    # 32 keys would fill 32 KiB of K+V at D 256 in bf16; 4 warps need 64
    resolved = resolve_config(SdpaConfig(warp_split=4), 256, torch.bfloat16, 8, torch.device("cpu"))
    assert (resolved.block_n, resolved.num_warps) == (64, 4)
    assert resolve_config(SdpaConfig(), 256, torch.bfloat16, 8, torch.device("cpu")).block_n == 32


def test_small_heads_take_two_warps_occupancy_four_and_two_stages_unless_told_otherwise():
    """One head a program at head tiles <= 64 (the H200 sweep of bench/results/smol-attn-h200.json); wider
    heads, several heads a program, warp split and split_merge keep 4 warps (or one a head), occupancy 2
    and 3 stages; explicit fields win. programs = occupancy * SMs over the head groups."""
    cpu = torch.device("cpu")

    def chosen(config, head_dim, kv_heads, dtype=torch.bfloat16):
        r = resolve_config(config, head_dim, dtype, kv_heads, cpu, True)
        return r.num_warps, r.occupancy, r.num_stages, r.programs

    sms = sm_count(cpu)
    for dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float32):
        for head_dim in (16, 32, 64):
            assert chosen(None, head_dim, 3, dtype) == (2, 4, 2, -(-4 * sms // 3))
        assert chosen(None, 128, 8, dtype) == (4, 2, 3, -(-2 * sms // 8))
        assert chosen(None, 256, 1, dtype) == (4, 2, 3, 2 * sms)
    assert chosen(SdpaConfig(heads=2), 64, 4) == (2, 2, 3, sms)  # one warp a head
    assert chosen(SdpaConfig(warp_split=4), 64, 3)[:3] == (4, 2, 3)
    assert chosen(SdpaConfig(split_merge=True), 64, 3)[:3] == (4, 2, 3)
    assert chosen(SdpaConfig(occupancy=3, num_warps=8, num_stages=4), 64, 3) == (8, 3, 4, 3 * sms // 3)
    assert chosen(SdpaConfig(occupancy=1), 64, 1)[1:3] == (1, 2)  # one field given, the others still chosen


BAD_FIELDS = [dict(warp_split=3), dict(warp_split=4, block_n=32), dict(warp_split=2, heads=2), dict(prefetch=-1),
              dict(merge_stages=0)]  # fmt: skip


@pytest.mark.parametrize("fields", [*BAD_FIELDS, dict(block_n=48)])
def test_config_fields_outside_their_rules_raise_contract_error(fields):
    (q, k, v), info = make_case([(1, 0, 40)], rows=64, head_dim=16, kv_heads=2)
    with pytest.raises(ContractError):
        sdpa_varlen(q, k, v, info, config=SdpaConfig(**fields))


# ---- on the GPU (H200: `python3 -m pytest -m gpu tests/test_sdpa_varlen_variants.py -q`) -----------------
GPU_VARIANTS = [  # every variant, each path (2-D, 3-D heads, warp split) with and without prefetch
    dict(warp_split=4),
    dict(prefetch=4),
    dict(prefetch=4, heads=2),
    dict(prefetch=8, warp_split=4, occupancy=1),
    dict(merge_stages=2, merge_tile=16384, warp_split=2),
]


@pytest.mark.gpu
@pytest.mark.parametrize("overrides", GPU_VARIANTS, ids=str)
def test_variants_match_reference_at_sensenova_shapes_on_bf16_and_e4m3(overrides):
    from tests import test_fp8_gpu, test_sdpa_varlen_gpu

    config = SdpaConfig(**overrides)
    for run in (test_sdpa_varlen_gpu.run_case, test_fp8_gpu.run_case):
        run([1, 4, 16, 1, 300, 17, 4], [9100, 4, 2000, 1, 700, 4000, 129], rows=9216, config=config)
        run([1, 4, 1, 100], [5000, 20000, 30, 3000], rows=1100, window=1024, config=config)
        run([4, 16, 1], [300, 5000, 77], rows=8192, causal=False, config=config)
    lengths = torch.randint(64, 8193, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    test_sdpa_varlen_gpu.run_case([1] * 64, lengths, rows=8192, config=config)  # b64 decode
    for length, rows in ((1, 64), (17, 64), (1024, 1024), (9100, 9216), (16384, 16384)):  # one sequence
        test_sdpa_varlen_gpu.run_case([1], [length], rows=rows, pad=0, config=config)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("head_dim", "dtype", "kv_heads"),
    [(64, torch.bfloat16, 8), (256, torch.bfloat16, 8), (128, torch.float16, 8), (128, torch.float32, 2)],
)
def test_warp_split_with_prefetch_at_other_head_dims_and_dtypes(head_dim, dtype, kv_heads):
    from tests.test_sdpa_varlen_gpu import run_case

    atol = 1e-4 if dtype == torch.float32 else 2e-2
    config = SdpaConfig(warp_split=4, prefetch=4)
    run_case([1, 3, 1, 64], [1000, 3000, 7, 500], rows=4096, head_dim=head_dim, dtype=dtype, kv_heads=kv_heads,
             atol=atol, config=config)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("overrides", GPU_VARIANTS, ids=str)
def test_one_captured_graph_of_each_variant_replays_any_length(overrides):
    from batchkv.ops.sdpa.launch import _counters

    config, gen = SdpaConfig(**overrides), torch.Generator(device="cuda").manual_seed(5)
    k, v = (torch.randn(16384, 2, 8, 128, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(2))
    k[:, 1] = v[:, 1] = float("nan")  # the facade's scratch column: never read
    q = torch.randn(2, 32, 128, generator=gen, device="cuda").to(torch.bfloat16)
    info = torch.zeros(2, 4, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    info.copy_(torch.tensor([[0, 1, 0, 1], [0, 0, 0, 0]]))
    sdpa_varlen(q, k, v, info, out=out, config=config)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sdpa_varlen(q, k, v, info, out=out, config=config)
    for table in ([[0, 1, 0, 16384], [0, 0, 0, 0]], [[0, 1, 0, 9100], [0, 0, 0, 0]], [[1, 1, 0, 17], [0, 0, 0, 0]],
                  [[0, 2, 0, 1024], [0, 0, 0, 0]], [[0, 1, 0, 3000], [1, 1, 0, 4000]]):  # fmt: skip
        info.copy_(torch.tensor(table))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out.float(), sdpa_varlen_reference(q, k, v, info).float(), atol=2e-2, rtol=2e-2)
        assert not _counters(q.device, 0).any()
