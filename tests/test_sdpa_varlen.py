"""sdpa_varlen (Triton) against the torch reference, on awkward sizes, under the interpreter on CPU.

Every store starts as NaN; only the positions a segment may read are filled, so a kernel that
touches a slot past a kv_end, the scratch column or an unused column turns its output into NaN.
"""

from __future__ import annotations

import pytest
import torch

from batchkv.errors import ContractError
from batchkv.ops import sdpa_varlen_reference
from batchkv.ops.sdpa.launch import SdpaConfig, _counters, sdpa_varlen

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_case(segments, *, rows, columns=6, kv_heads=2, group=4, head_dim=32, pad=2, gap=0, lead=0,
              dtype=torch.float32, seed=0, shuffle=False):  # fmt: skip
    """q [T, Hq, D] and NaN-poisoned stores [rows, columns, Hkv, D] for (q_len, col, kv_end) segments.

    Segments are packed in order (zero-length ones included) after `lead` uncovered rows, `gap` more
    before each; `pad` uncovered rows follow; `shuffle`: the table's rows in a random order. Returns
    q, k_store, v_store, seq_info (int32 [S, 4]).
    """
    gen = torch.Generator().manual_seed(seed)
    table, q_start = [], lead
    for q_len, col, kv_end in segments:
        q_start += gap
        table.append((q_start, q_len, col, kv_end))
        q_start += q_len
    q = torch.randn(q_start + pad, kv_heads * group, head_dim, generator=gen)
    k = torch.full((rows, columns, kv_heads, head_dim), float("nan"))
    v = torch.full_like(k, float("nan"))
    for col in {c for _, c, _ in segments}:
        end = max(e for _, c, e in segments if c == col)
        for t in range(max(0, end - rows), end):  # the resident history of this column
            k[t % rows, col] = torch.randn(kv_heads, head_dim, generator=gen)
            v[t % rows, col] = torch.randn(kv_heads, head_dim, generator=gen)
    info = torch.tensor(table, dtype=torch.int32).reshape(-1, 4)
    if shuffle:
        info = info[torch.randperm(info.shape[0], generator=gen)]
    return (x.to(DEVICE, dtype) for x in (q, k, v)), info.to(DEVICE)


def check(segments, *, causal=True, window=0, config=None, atol=2e-5, **case):
    """sdpa_varlen into a NaN-filled `out` equals the reference: covered rows closely, the rest exactly
    zero; the merge counters are all zero afterwards."""
    (q, k, v), info = make_case(segments, **case)
    out = sdpa_varlen(q, k, v, info, causal=causal, window=window, config=config, out=torch.full_like(q, float("nan")))
    ref = sdpa_varlen_reference(q, k, v, info, causal=causal, window=window)
    covered = torch.zeros(q.shape[0], dtype=torch.bool)
    for q_start, q_len, _, _ in info.tolist():
        covered[q_start : q_start + q_len] = True
    assert not out.isnan().any()
    torch.testing.assert_close(out[covered], ref[covered], atol=atol, rtol=1e-4)
    assert torch.equal(out[~covered], torch.zeros_like(out[~covered]))  # uncovered rows: exact zeros
    assert not _counters(q.device, 0).any()  # every launch leaves its counters at zero
    return out, ref


@pytest.mark.parametrize("group", [1, 4, 8])
def test_decode_matches_reference_for_each_gqa_ratio(group):
    check([(1, 0, 1), (1, 3, 17), (1, 1, 130), (1, 4, 257)], rows=260, group=group, kv_heads=8 // group)


@pytest.mark.parametrize("q_len", [3, 16])
def test_verify_blocks_match_reference(q_len):
    check([(q_len, 2, q_len + 5), (q_len, 0, 95)], rows=100, kv_heads=1)


def test_prefill_chunks_take_the_long_path_and_match_reference():
    check([(40, 1, 40), (40, 0, 113)], rows=120, head_dim=16, config=SdpaConfig(block_m_long=32))


def test_mixed_table_of_decode_verify_and_prefill_matches_reference():
    # Sequence 0 appears twice (two runs), as a split declaration packs it.
    segments = [(1, 3, 200), (4, 0, 63), (0, 4, 0), (40, 1, 77), (2, 0, 65), (1, 2, 1)]
    check(segments, rows=210, group=3, kv_heads=2, head_dim=16)


@pytest.mark.parametrize("window", [1, 7, 64])
def test_sliding_window_matches_reference(window):
    check([(1, 0, 150), (3, 1, 49), (40, 2, 90)], rows=160, window=window, head_dim=16, kv_heads=1)


def test_wrapped_ring_matches_reference():
    # rows = window + max_write - 1 with window 20, max_write 5: kv_end far past rows wraps the ring.
    check([(1, 0, 301), (5, 1, 57), (3, 2, 24)], rows=24, window=20, head_dim=16)


def test_ring_smaller_than_the_step_gives_zeros_for_rows_without_keys():
    out, _ = check([(40, 0, 90), (1, 1, 30)], rows=16, head_dim=16)
    assert torch.equal(out[:24], torch.zeros_like(out[:24]))  # positions 50..73 have no resident key


@pytest.mark.parametrize("window", [0, 6])
def test_non_causal_draft_blocks_match_reference(window):
    segments = [(4, 0, 70), (16, 1, 33), (40, 2, 100), (1, 3, 9)]
    check(segments, rows=110, causal=False, window=window, head_dim=16, kv_heads=1)


@pytest.mark.parametrize(("programs", "min_blocks"), [(1, 1), (3, 1), (50, 1), (7, 3)])
def test_any_split_program_count_gives_the_reference(programs, min_blocks):
    # 1: one program walks every item and writes each directly; 3: pieces cross item boundaries;
    # 50: most programs idle, the long item merged from many; min_blocks 3: fewer programs share it.
    config = SdpaConfig(programs=programs, min_blocks=min_blocks, block_n=16)
    check([(1, 0, 70), (3, 2, 33), (1, 1, 1190)], rows=1200, head_dim=16, kv_heads=1, config=config)


def test_items_a_single_program_covers_are_written_directly_and_match_the_reference():
    # min_blocks above the total: one program per head, every item its own (no partial, no counter).
    config = SdpaConfig(min_blocks=1000, block_n=16)
    check([(1, 0, 70), (4, 2, 33), (1, 1, 300), (2, 3, 17)], rows=310, head_dim=16, config=config)


def test_the_last_program_merges_many_partials_in_several_rounds_and_resets_its_counters():
    # 70 programs share one 1190-key item; 4 partials per round trip: 18 rounds for the last one.
    config = SdpaConfig(programs=70, block_n=16, merge_tile=4 * 4 * 16)
    (q, k, v), info = make_case([(1, 0, 1190), (3, 1, 45)], rows=1200, head_dim=16, kv_heads=1)
    first = sdpa_varlen(q, k, v, info, config=config)
    assert not _counters(q.device, 0).any()
    torch.testing.assert_close(first, sdpa_varlen_reference(q, k, v, info), atol=2e-5, rtol=1e-4)
    assert torch.equal(sdpa_varlen(q, k, v, info, config=config), first)  # a second call: same counters, same result


def test_the_64_bit_work_axis_gives_the_32_bit_result(monkeypatch):
    import batchkv.ops.sdpa.launch as launcher

    segments, config = [(1, 0, 300), (3, 1, 45), (1, 2, 7)], SdpaConfig(programs=5, block_n=16)
    out32, _ = check(segments, rows=310, head_dim=16, kv_heads=1, config=config)
    monkeypatch.setattr(launcher, "AXIS32_LIMIT", 0)  # every work-axis bound now counts as too large
    out64, _ = check(segments, rows=310, head_dim=16, kv_heads=1, config=config)
    assert torch.equal(out32, out64)


@pytest.mark.parametrize("heads", [2, 4])
def test_programs_serving_several_kv_heads_match_reference(heads):
    segments = [(1, 0, 129), (4, 1, 300), (1, 2, 17), (16, 3, 90), (40, 4, 60)]
    check(segments, rows=300, kv_heads=4, group=2, head_dim=16, config=SdpaConfig(heads=heads, block_n=16))


def test_rows_between_and_after_segments_are_zeroed_by_the_split_programs():
    # Uncovered rows before every segment and 40 after: several zeroing rounds per program.
    check([(1, 0, 50), (3, 1, 20), (40, 2, 90), (1, 3, 5)], rows=100, gap=3, pad=40, head_dim=16, kv_heads=1)


@pytest.mark.parametrize("programs", [1, 3, 7])
def test_rows_before_and_after_one_run_of_written_rows_are_zeroed(programs):
    # The written rows are one run (empty table rows inside it, the table out of order), 21 uncovered rows
    # before it and 30 after: the programs zero around the run without testing each row against the table.
    segments = [(1, 0, 50), (0, 4, 0), (3, 1, 20), (40, 2, 90), (0, 5, 0), (1, 3, 5)]
    config = SdpaConfig(programs=programs, block_n=16)
    check(segments, rows=100, lead=21, pad=30, shuffle=True, head_dim=16, kv_heads=1, config=config)


@pytest.mark.parametrize("programs", [1, 2, 5])
def test_programs_step_over_rows_without_items_between_their_items(programs):
    # Empty rows, prompt chunks (the long kernel's) and a run without keys between decode and verify items
    # (a 16-token block: 4 items); with few programs each walks many rows and its pieces cross segments.
    segments = [(0, 0, 0), (1, 0, 70), (40, 1, 90), (0, 2, 0), (0, 3, 0), (3, 2, 33), (16, 3, 50), (40, 4, 60),
                (1, 4, 61), (2, 5, 0), (1, 5, 9), (0, 1, 0)]  # fmt: skip
    check(segments, rows=100, head_dim=16, kv_heads=1, config=SdpaConfig(programs=programs, block_n=16))


@pytest.mark.parametrize("skip_masks", [True, False])
def test_unmasked_interior_blocks_give_the_masked_result(skip_masks):
    # Windowed rows over a wrapped ring: first and last blocks of each piece need masks, others not.
    config = SdpaConfig(skip_masks=skip_masks, block_n=16, programs=3)
    check([(1, 0, 301), (5, 1, 157), (16, 2, 99)], rows=120, window=70, head_dim=16, kv_heads=1, config=config)


def test_head_dim_64_and_a_long_key_tile_match_reference():
    check([(1, 0, 129), (5, 1, 300)], rows=300, head_dim=64, group=2, config=SdpaConfig(block_n=128))


def test_fp16_storage_matches_reference_within_half_precision():
    check([(1, 0, 80), (3, 1, 21)], rows=90, dtype=torch.float16, atol=2e-3)


def test_empty_table_rows_and_uncovered_rows_come_out_as_exact_zeros():
    (q, k, v), info = make_case([(0, 0, 0), (1, 1, 5), (0, 2, 9)], rows=16, pad=5)
    out = torch.full_like(q, float("nan"))
    assert sdpa_varlen(q, k, v, info, out=out) is out
    torch.testing.assert_close(out[:1], sdpa_varlen_reference(q, k, v, info)[:1])
    assert torch.equal(out[1:], torch.zeros_like(out[1:]))


def test_max_q_len_within_q_short_skips_the_long_launch_and_gives_the_same_rows(monkeypatch):
    """A table of decode and verify runs, 22 packed rows (over q_short, so the long kernel would launch):
    under max_q_len=16 it does not and the rows match the reference; a 20-token run under max_q_len=None
    still takes it; the reference refuses a run past a promised bound, and a bound below 1 is refused."""
    from batchkv.ops.sdpa import launch

    calls = []
    real = launch._launch_long
    monkeypatch.setattr(launch, "_launch_long", lambda *args, **kwargs: (calls.append(1), real(*args, **kwargs)))
    segments = [(1, 0, 40), (4, 1, 57), (1, 2, 24), (16, 3, 33)]
    (q, k, v), info = make_case(segments, rows=64, pad=0)
    hinted = sdpa_varlen(q, k, v, info, max_q_len=16)
    assert calls == []
    plain = sdpa_varlen(q, k, v, info)
    assert len(calls) == 1  # the same call without the bound launches it (it finds no work)
    torch.testing.assert_close(hinted, sdpa_varlen_reference(q, k, v, info, max_q_len=16), atol=2e-5, rtol=1e-4)
    assert torch.equal(hinted, plain)
    (q, k, v), info = make_case([(20, 0, 40), (1, 1, 9)], rows=64, pad=0)
    sdpa_varlen(q, k, v, info)
    assert len(calls) == 2
    with pytest.raises(ContractError, match="max_q_len is 16"):
        sdpa_varlen_reference(q, k, v, info, max_q_len=16)
    with pytest.raises(ContractError, match="max_q_len"):
        sdpa_varlen(q, k, v, info, max_q_len=0)


def test_an_all_empty_table_zeroes_every_row():
    (q, k, v), info = make_case([(0, 0, 0), (0, 1, 0)], rows=16, pad=3)
    assert torch.equal(sdpa_varlen(q, k, v, info), torch.zeros_like(q))


def _inputs():
    (q, k, v), info = make_case([(1, 0, 4)], rows=8, pad=0)
    return dict(q=q, k_store=k, v_store=v, seq_info=info)


BAD = {
    "seq_info int64": lambda a: a.update(seq_info=a["seq_info"].long()),
    "seq_info [S, 3]": lambda a: a.update(seq_info=a["seq_info"][:, :3]),
    "seq_info on another device": lambda a: a.update(seq_info=a["seq_info"].to("meta")),
    "Hq not a multiple of Hkv": lambda a: a.update(q=a["q"][:, :7]),
    "head_dim 24": lambda a: a.update(
        q=a["q"][..., :24], k_store=a["k_store"][..., :24], v_store=a["v_store"][..., :24]
    ),
    "int store": lambda a: a.update(k_store=a["k_store"].int(), v_store=a["v_store"].int()),
    "mixed store dtypes": lambda a: a.update(v_store=a["v_store"].half()),
    "strided last dim": lambda a: a.update(q=a["q"].transpose(1, 2).contiguous().transpose(1, 2)),
    "store shapes differ": lambda a: a.update(v_store=a["v_store"][:4]),
    "out of the wrong shape": lambda a: a.update(out=torch.empty_like(a["q"][:, :4])),
    "out of the wrong dtype": lambda a: a.update(out=torch.empty_like(a["q"], dtype=torch.float16)),
    "negative window": lambda a: a.update(window=-1),
    "no query heads": lambda a: a.update(q=a["q"][:, :0]),
    "a scale that is no number": lambda a: a.update(scale="0.1"),
    "a boolean scale": lambda a: a.update(scale=True),
}


@pytest.mark.parametrize("breach", list(BAD))
def test_contract_breaches_raise_contract_error(breach):
    args = _inputs()
    BAD[breach](args)
    with pytest.raises(ContractError):
        sdpa_varlen(**args)
