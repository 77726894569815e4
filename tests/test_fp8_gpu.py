"""e4m3 K/V storage on the GPU: SenseNova shapes with bf16 queries, the hardware write bit for bit,
one captured graph replaying length mixes, and the engine with graphs on e4m3 storage.

Run on the H200: `python3 -m pytest -m gpu tests/test_fp8_gpu.py -q`.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from batchkv.ops import kv_write_reference, sdpa_varlen_reference
from batchkv.ops.reference import quantize_fp8
from batchkv.ops.support import empty_scales, to_scale_layout
from tests.test_sdpa_varlen_gpu import COLUMNS, poisoned_store, table

pytestmark = pytest.mark.gpu
FP8 = torch.float8_e4m3fn


def assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal bits, or a message naming how many elements differ and the first few (index, got, want)."""
    view = {FP8: torch.uint8, torch.float16: torch.int16}.get(got.dtype, torch.int32)
    differ = (got.view(view) != want.view(view)).nonzero()
    shown = [(tuple(i.tolist()), got[tuple(i)].float().item(), want[tuple(i)].float().item()) for i in differ[:6]]
    assert len(differ) == 0, f"{len(differ)} of {got.numel()} elements differ, first: {shown}"


def run_case(q_lens, kv_ends, *, rows, kv_heads=8, group=4, head_dim=128, q_dtype=torch.bfloat16, causal=True,
             window=0, pad=3, seed=0, atol=2e-2, config=None, v_magnitude=None):  # fmt: skip
    """e4m3 codes of NaN-poisoned stores (NaN codes and scales off every resident history) against the
    reference on the same codes, scale planes in the store's layout; q in q_dtype, so the dots run in it.
    v_magnitude: V times it, and the relative error of the covered rows bounded at 5e-3. config None:
    the default with q unrounded (its prompt chunks round q: tests/test_fp8_qk_long.py)."""
    from batchkv.ops.sdpa.launch import DEFAULT_CONFIG, _counters, sdpa_varlen

    if config is None:
        config = replace(DEFAULT_CONFIG, e4m3_qk_long=False, narrow=replace(DEFAULT_CONFIG.narrow, e4m3_qk_long=False))

    gen = torch.Generator(device="cuda").manual_seed(seed)
    cols = torch.randperm(64, generator=torch.Generator().manual_seed(seed))[: len(q_lens)].tolist()
    k, v = poisoned_store(rows, kv_heads, head_dim, torch.float32, kv_ends, cols, gen)
    (kc, ks), (vc, vs) = quantize_fp8(k), quantize_fp8(v * (v_magnitude or 1.0))
    ks, vs = to_scale_layout(ks), to_scale_layout(vs)
    del k, v
    info, width = table(q_lens, kv_ends, cols, 2 * len(q_lens))
    q = torch.randn(width + pad, kv_heads * group, head_dim, generator=gen, device="cuda").to(q_dtype)
    out = torch.full_like(q, float("nan"))
    sdpa_varlen(q, kc, vc, info, causal=causal, window=window, out=out, config=config, k_scale=ks, v_scale=vs)
    ref = sdpa_varlen_reference(q, kc, vc, info, causal=causal, window=window, k_scale=ks, v_scale=vs)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref.float(), atol=atol * (v_magnitude or 1.0), rtol=atol)
    if v_magnitude is not None:
        assert (out[:width].float() - ref[:width].float()).norm() / ref[:width].float().norm() < 5e-3
    assert torch.equal(out[width:], torch.zeros_like(out[width:]))
    assert not _counters(q.device, 0).any()


def test_sensenova_decode_batch_on_e4m3_matches_reference():
    lengths = torch.randint(64, 8193, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    run_case([1] * 64, lengths, rows=8192)


def test_sensenova_mixed_decode_verify_and_prefill_on_e4m3_match_reference():
    run_case([1, 4, 16, 1, 300, 17, 4], [9100, 4, 2000, 1, 700, 4000, 129], rows=9216)


def test_e4m3_sliding_window_over_a_wrapped_ring_and_non_causal_blocks_match_reference():
    run_case([1, 4, 1, 100], [5000, 20000, 30, 3000], rows=1100, window=1024)
    run_case([4, 16, 1], [300, 5000, 77], rows=8192, causal=False)


@pytest.mark.parametrize(
    ("head_dim", "q_dtype"),
    [(16, torch.bfloat16), (16, torch.float32), (64, torch.bfloat16), (256, torch.bfloat16), (128, torch.float16)],
)
def test_e4m3_other_head_dims_and_fp16_queries_match_reference(head_dim, q_dtype):
    run_case([1, 3, 1, 64], [1000, 3000, 7, 500], rows=4096, head_dim=head_dim, q_dtype=q_dtype)


@pytest.mark.parametrize("v_magnitude", [1e-3, 2e4])
def test_e4m3_keeps_its_precision_for_small_and_large_values(v_magnitude):
    # p * v_scale goes to the PV dot in fp16: without the 2^P_SHIFT on p, V of 1e-3 lost ~1.5% to
    # fp16's subnormals; too large a shift would overflow V of 2e4
    run_case([1, 4, 16, 1, 300], [3000, 500, 2000, 77, 700], rows=4096, v_magnitude=v_magnitude)


def test_e4m3_with_fp32_queries_matches_reference_tightly():
    run_case([1, 5, 40], [999, 333, 200], rows=1024, q_dtype=torch.float32, kv_heads=2, atol=1e-4)


def test_every_swept_config_on_e4m3_matches_reference():
    from batchkv.ops.sdpa.launch import SdpaConfig

    sweep = [{"block_n": 64}, {"block_n": 128}, {"heads": 2, "occupancy": 4}, {"heads": 8, "occupancy": 1},
             {"min_blocks": 4}, {"num_stages": 4}, {"skip_masks": False},
             {"block_m_long": 64, "num_warps_long": 4, "num_stages_long": 2}]  # fmt: skip
    for overrides in sweep:
        run_case([1, 4, 16, 1, 300, 1, 2], [4000, 4, 2000, 1, 700, 64, 3000], rows=4096, config=SdpaConfig(**overrides))


def test_the_hardware_pair_conversion_gives_torchs_e4m3_values_for_every_int16():
    from tests.test_fp8_kernels import unpack_every_pair

    even, odd, want_even, want_odd = unpack_every_pair(True, torch.device("cuda"))  # PRMT + cvt.rn.f16x2.e4m3x2
    for got, want in ((even, want_even), (odd, want_odd)):
        assert torch.equal(got.isnan(), want.isnan())  # e4m3's NaN codes give NaN (payload bits may differ)
        finite = ~want.isnan()
        assert_same_bits(got[finite], want[finite])  # -0 and the subnormals included


def test_one_sequence_decode_on_e4m3_merges_many_programs_and_matches_reference():
    for length in (17, 1024, 16384):
        run_case([1], [length], rows=16384, pad=0)


def test_the_gpu_write_stores_the_reference_codes_and_scales_bit_for_bit():
    from batchkv.ops.kv_write_triton import kv_write

    gen = torch.Generator(device="cuda").manual_seed(1)
    width, kv_heads, head_dim, rows, columns = 64, 8, 128, 64, 64
    slots_total = rows * columns
    spread = torch.logspace(-20, 20, width, device="cuda")[:, None, None]
    k = (torch.randn(width, kv_heads, head_dim, generator=gen, device="cuda") * spread).to(torch.bfloat16)
    v = torch.randn(width, kv_heads, head_dim, generator=gen, device="cuda").to(torch.bfloat16)
    k[3, 2] = 0.0
    slots = torch.randperm(slots_total, device="cuda")[:width]
    planes = [torch.full((slots_total, kv_heads, head_dim), float("nan"), device="cuda").to(FP8) for _ in range(2)]
    planes += [empty_scales(rows, columns, kv_heads, device="cuda").fill_(float("nan")) for _ in range(2)]
    want = [p.clone() for p in planes]
    kv_write(planes[0], planes[1], k, v, slots, k_scale=planes[2], v_scale=planes[3])
    kv_write_reference(want[0], want[1], k, v, slots, k_scale=want[2], v_scale=want[3])
    for got, expected in zip(planes, want, strict=True):
        assert_same_bits(got, expected)


def test_one_captured_graph_replays_length_mixes_with_the_e4m3_write():
    from batchkv.ops.kv_write_triton import kv_write
    from batchkv.ops.sdpa.launch import sdpa_varlen

    rows, kv_heads, head_dim, width = 4096, 8, 128, 24
    gen = torch.Generator(device="cuda").manual_seed(3)
    shape = (rows, COLUMNS, kv_heads, head_dim)
    (kc, ks), (vc, vs) = (quantize_fp8(torch.randn(shape, generator=gen, device="cuda")) for _ in range(2))
    ks, vs = to_scale_layout(ks), to_scale_layout(vs)
    flat = [kc.view(rows * COLUMNS, kv_heads, head_dim), vc.view(rows * COLUMNS, kv_heads, head_dim), ks, vs]
    q = torch.zeros(width, 32, head_dim, dtype=torch.bfloat16, device="cuda")
    k_new, v_new = torch.zeros(2, width, kv_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    slots = torch.zeros(width, dtype=torch.int64, device="cuda")
    info = torch.zeros(16, 4, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)

    def step():
        kv_write(flat[0], flat[1], k_new, v_new, slots, k_scale=flat[2], v_scale=flat[3])
        sdpa_varlen(q, kc, vc, info, out=out, k_scale=ks, v_scale=vs)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for mix in ([(1, 5, 4000), (1, 9, 17), (4, 2, 900)], [(16, 9, 33), (1, 63, 4096), (4, 5, 4004)], [(1, 7, 4096)]):
        host_info = torch.zeros(16, 4, dtype=torch.int32)
        host_slots = torch.arange(width) * COLUMNS + 64  # padding -> scratch column
        q_start = 0
        for s, (q_len, col, kv_end) in enumerate(mix):
            host_info[s] = torch.tensor([q_start, q_len, col, kv_end])
            host_slots[q_start : q_start + q_len] = (torch.arange(kv_end - q_len, kv_end) % rows) * COLUMNS + col
            q_start += q_len
        info.copy_(host_info)
        slots.copy_(host_slots)
        for x in (q, k_new, v_new):
            x.copy_(torch.randn(x.shape, generator=gen, device="cuda"))
        expect = [t.clone() for t in flat]
        kv_write_reference(expect[0], expect[1], k_new, v_new, slots, k_scale=expect[2], v_scale=expect[3])
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(flat, expect, strict=True):
            assert_same_bits(got, want)
        ref = sdpa_varlen_reference(q, kc, vc, info, k_scale=ks, v_scale=vs)
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
        assert torch.equal(out[q_start:], torch.zeros_like(out[q_start:]))


def test_the_engine_with_graphs_on_e4m3_storage_decodes_what_it_decodes_eagerly():
    from batchkv.executor import Engine, Request, SamplingParams
    from tests.toy_model import ToyModel

    model = ToyModel(vocab=512, hidden=256, heads=8, kv_heads=2, head_dim=64, window=32, dtype=torch.bfloat16,
                     device="cuda", seed=0)  # fmt: skip
    prompts = [list(range(i, i + 40 + 13 * i)) for i in range(6)]
    outputs = []
    for use_graphs in (False, True):
        engine = Engine(model, max_seqs=4, capacity=320, max_step_tokens=64, prefill_chunk=32, device="cuda",
                        use_graphs=use_graphs, kv_dtype=FP8)  # fmt: skip
        assert engine.cache.config.kv_dtype == FP8 and engine.uses_graphs == use_graphs
        ids = [engine.submit(Request(p, SamplingParams(max_new_tokens=30))) for p in prompts]
        tokens: dict[int, list[int]] = {i: [] for i in ids}
        for event in engine.stream():
            if event.token is not None:
                tokens[event.request_id].append(event.token)
        outputs.append([tokens[i] for i in ids])
        engine.assert_idle()
    assert outputs[0] == outputs[1]
