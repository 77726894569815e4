"""The two-launch split-KV variant (SdpaConfig.split_merge) against the reference, under the
interpreter on NaN-poisoned stores: one and several sequences, verify blocks, empty segments and
uncovered rows, runs of no keys (more programs than blocks), a window over a wrapped ring,
non-causal blocks, e4m3 codes; steps wider than q_short take the main path. On the GPU: one
captured graph replayed over new lengths."""

from __future__ import annotations

import pytest
import torch

from batchkv.errors import ContractError
from batchkv.ops import sdpa_varlen_reference
from batchkv.ops.reference import quantize_fp8
from batchkv.ops.sdpa import launch
from batchkv.ops.sdpa.launch import SdpaConfig, resolve_config, sdpa_varlen
from batchkv.ops.sdpa.splitkv import takes_split_merge
from batchkv.ops.support import to_scale_layout
from tests.test_sdpa_varlen import check, make_case

SPLIT = SdpaConfig(split_merge=True, block_n=16, programs=5)


@pytest.mark.parametrize("group", [1, 4])
def test_one_decoding_sequence_split_over_every_program_matches_reference(group):
    check([(1, 0, 200)], rows=210, group=group, kv_heads=2, head_dim=16, pad=0, config=SPLIT)


def test_decode_verify_empty_segments_and_uncovered_rows_match_reference():
    segments = [(1, 3, 200), (0, 4, 0), (3, 1, 40), (1, 2, 1)]
    check(segments, rows=210, group=3, kv_heads=2, head_dim=16, gap=1, pad=3, config=SPLIT)


def test_more_programs_than_key_blocks_leave_empty_runs_that_the_merge_ignores():
    check([(1, 0, 40), (2, 1, 7)], rows=64, kv_heads=1, head_dim=16, config=SdpaConfig(split_merge=True, programs=9))


def test_a_window_over_a_wrapped_ring_matches_reference():
    check([(1, 0, 301), (3, 1, 57), (2, 2, 24)], rows=24, window=20, kv_heads=2, head_dim=16, config=SPLIT)


def test_non_causal_blocks_with_a_window_match_reference():
    check([(4, 0, 70), (1, 1, 33)], rows=80, causal=False, window=6, kv_heads=1, head_dim=32, config=SPLIT)


def test_steps_wider_than_q_short_take_the_main_path():
    # a 40-token prompt chunk: T > q_short, so the split and long kernels serve the step
    check([(40, 1, 40), (1, 0, 90)], rows=100, kv_heads=1, head_dim=16, config=SPLIT)


def test_as_the_narrow_config_it_serves_narrow_steps_only():
    config = SdpaConfig(block_n=16, narrow=SPLIT, narrow_width=2)
    check([(1, 0, 150), (1, 1, 9)], rows=160, kv_heads=2, head_dim=16, pad=0, config=config)  # T = 2: split_merge
    check([(1, 0, 150), (3, 1, 9)], rows=160, kv_heads=2, head_dim=16, pad=0, config=config)  # T = 4: the outer


@pytest.mark.parametrize(
    ("segments", "takes"),
    [
        ([(1, 0, 150)], True),  # one decoding sequence
        ([(1, 0, 150), (1, 1, 9)], True),  # two: T = 2
        ([(16, 0, 60), (0, 1, 0)], True),  # a verify block over the one-sequence cache's 2-row table
        ([(1, 0, 150), (1, 1, 9), (1, 2, 40), (1, 3, 70)], False),  # four decoding sequences: the main path
    ],
)
def test_the_default_config_takes_split_merge_for_one_sequence_or_two_tokens(monkeypatch, segments, takes):
    calls = []
    real = launch.split_merge
    monkeypatch.setattr(launch, "split_merge", lambda *a: calls.append(1) or real(*a))
    check(segments, rows=160, kv_heads=1, head_dim=16, pad=0)  # config None: DEFAULT_CONFIG
    assert bool(calls) == takes


@pytest.mark.parametrize("head_dim", [16, 32])
def test_e4m3_stores_match_reference_on_their_codes(head_dim):
    (q, k, v), info = make_case([(1, 0, 200), (3, 1, 57)], rows=210, head_dim=head_dim, kv_heads=2, pad=2)
    (k_codes, k_scale), (v_codes, v_scale) = quantize_fp8(k), quantize_fp8(v)
    scales = dict(k_scale=to_scale_layout(k_scale), v_scale=to_scale_layout(v_scale))
    out = torch.full_like(q, float("nan"))
    sdpa_varlen(q, k_codes, v_codes, info, config=SPLIT, out=out, **scales)
    ref = sdpa_varlen_reference(q, k_codes, v_codes, info, **scales)
    torch.testing.assert_close(out[:4], ref[:4], atol=2e-5, rtol=1e-4)
    assert torch.equal(out[4:], torch.zeros_like(out[4:]))


@pytest.mark.parametrize(("head_dim", "group"), [(64, 5), (128, 8), (64, 1), (256, 2)])
def test_head_dims_and_gqa_groups_match_reference(head_dim, group):
    check([(2, 0, 70), (1, 1, 33)], rows=80, group=group, kv_heads=1, head_dim=head_dim, pad=1, config=SPLIT, atol=1e-4)


@pytest.mark.parametrize("group", [3, 4])
def test_a_verify_block_of_sixteen_queries_in_one_tile_matches_reference(group):
    assert takes_split_merge(16, group, resolve_config(SPLIT, 16, torch.float32, 1, torch.device("cpu")))
    check([(16, 0, 60)], rows=64, group=group, kv_heads=1, head_dim=16, pad=0, config=SPLIT)


def test_live_segments_scattered_in_a_long_table_match_reference():
    segments = [(0, 0, 0)] * 17 + [(1, 1, 50)] + [(0, 0, 0)] * 9 + [(2, 2, 30)] + [(0, 0, 0)] * 20
    check(segments, rows=64, kv_heads=2, head_dim=16, pad=2, config=SPLIT)


@pytest.mark.parametrize("window", [1, 2, 5, 17])
def test_windows_narrower_than_a_verify_block_match_reference(window):
    check([(5, 0, 100), (4, 1, 5), (2, 2, 30)], rows=128, window=window, kv_heads=1, head_dim=16, config=SPLIT)


def test_more_programs_than_one_merge_round_takes_match_reference():
    config = SdpaConfig(split_merge=True, block_n=16, programs=70)  # 64 partials per round: two rounds
    check([(1, 0, 1200), (3, 1, 17)], rows=1210, kv_heads=1, head_dim=16, config=config)


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.float16])
def test_e4m3_at_head_dim_128_matches_reference(q_dtype):
    (q, k, v), info = make_case([(1, 0, 70), (3, 1, 33)], rows=80, head_dim=128, kv_heads=1, pad=1)
    (k_codes, k_scale), (v_codes, v_scale) = quantize_fp8(k), quantize_fp8(v)
    scales = dict(k_scale=to_scale_layout(k_scale), v_scale=to_scale_layout(v_scale))
    q = q.to(q_dtype)
    out = torch.full_like(q, float("nan"))
    sdpa_varlen(q, k_codes, v_codes, info, config=SPLIT, out=out, **scales)
    ref = sdpa_varlen_reference(q, k_codes, v_codes, info, **scales)
    atol = 2e-5 if q_dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out[:4].float(), ref[:4].float(), atol=atol, rtol=1e-3)
    assert torch.equal(out[4:], torch.zeros_like(out[4:]))


def test_steps_whose_tiles_would_be_taller_than_the_limit_take_the_main_path():
    cfg = resolve_config(SPLIT, 16, torch.float32, 1, torch.device("cpu"))
    assert takes_split_merge(16, 4, cfg) and not takes_split_merge(16, 5, cfg)  # 64 rows, 80 rows
    assert not takes_split_merge(17, 1, cfg)  # wider than q_short
    assert takes_split_merge(8, 4, cfg, quant=True) and not takes_split_merge(16, 4, cfg, quant=True)  # e4m3: 32
    check([(3, 0, 60), (7, 1, 40), (1, 2, 9)], rows=64, group=8, kv_heads=1, head_dim=16, config=SPLIT)


def test_a_table_that_overlaps_itself_writes_nothing_outside_out():
    # outside the contract: three live segments over the one token of a T = 1 step, one of them
    # claiming 5 queries; the kernels may compute anything for row 0 but must stay in bounds
    (q, k, v), _ = make_case([(1, 0, 60)], rows=64, kv_heads=2, head_dim=16, pad=0)
    info = torch.tensor([[0, 1, 0, 60], [0, 5, 0, 60], [0, 1, 0, 30]], dtype=torch.int32)
    guarded = torch.full((3, *q.shape[1:]), 7.0)
    sdpa_varlen(q, k, v, info, config=SPLIT, out=guarded[1:2])
    assert torch.equal(guarded[0], torch.full_like(guarded[0], 7.0))
    assert torch.equal(guarded[2], torch.full_like(guarded[2], 7.0))


@pytest.mark.parametrize("bad", [{"heads": 2}, {"warp_split": 2}, {"prefetch": 1}])
def test_split_merge_refuses_the_options_it_does_not_run(bad):
    with pytest.raises(ContractError, match="split_merge"):
        resolve_config(SdpaConfig(split_merge=True, **bad), 16, torch.float32, 2, torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (run on the GPU machine)")
def test_one_captured_graph_replays_new_lengths_on_the_h200_shape():
    rows, kv_heads, head_dim = 16384, 8, 128
    gen = torch.Generator(device="cuda").manual_seed(5)
    k = torch.randn(rows, 3, kv_heads, head_dim, generator=gen, device="cuda").to(torch.bfloat16)
    v = torch.randn(rows, 3, kv_heads, head_dim, generator=gen, device="cuda").to(torch.bfloat16)
    k[:, 2], v[:, 2] = float("nan"), float("nan")  # the scratch column: never read
    q = torch.randn(2, 32, head_dim, generator=gen, device="cuda").to(torch.bfloat16)
    info = torch.tensor([[0, 1, 0, 16], [1, 1, 1, 16]], dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    config = SdpaConfig(split_merge=True)
    sdpa_varlen(q, k, v, info, out=out, config=config)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sdpa_varlen(q, k, v, info, out=out, config=config)
    for ends in ([1, 16384], [9100, 1024], [16384, 0], [17, 4096]):
        info[:, 1] = torch.tensor([1, int(ends[1] > 0)], dtype=torch.int32)
        info[:, 3] = torch.tensor(ends, dtype=torch.int32)
        graph.replay()
        ref = sdpa_varlen_reference(q, k, v, info)
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
        if not ends[1]:
            assert torch.equal(out[1], torch.zeros_like(out[1]))  # an empty segment's row: zeros
