"""FP8 compute on the GPU: the hardware paths (Triton quantiser, e4m3 few-row kernel, cuBLASLt's scaled
matmul) against the exact emulation at the 8B shapes, under graph replay, and through the engine.

Run on the H200: `python3 -m pytest -m gpu tests/test_quant_gpu.py -q`.

Tolerance: the hardware and the emulation multiply the same e4m3 codes exactly. With exact
accumulation they differ only in the order of the float32 sums, so outputs agree to within 2 bf16
ulps: |got - want| <= 2^-7 |want| + 2^-7 rms(want). With the scaled matmul's fast accumulation (the
default: Hopper's FP8 tensor cores carry fewer bits between k-blocks) the bound is 2^-5 instead.
"""

from __future__ import annotations

import pytest
import torch

from batchkv.models.quant import fp8 as fp8_module
from batchkv.models.quant import producers
from batchkv.models.quant.fp8 import Fp8Linear, fp8_matmul, fp8_matmul_emulated, quantize_rows, quantize_rows_torch

pytestmark = pytest.mark.gpu

SHAPES_8B = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (28672, 4096), (4096, 14336)]  # [N, K]


def assert_within_tolerance(got: torch.Tensor, want: torch.Tensor, tol: float = 2**-7) -> None:
    got, want = got.float(), want.float()
    scale = want.pow(2).mean().sqrt()
    bad = (got - want).abs() > tol * want.abs() + tol * scale
    assert not bad.any(), f"{int(bad.sum())} of {got.numel()} outside, worst {(got - want).abs().max():.4g}"


@pytest.mark.parametrize("rows", [1, 3, 16, 257])
def test_triton_quantiser_gives_the_torch_codes_and_scales_bit_for_bit(rows):
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = (torch.randn(rows, 4096, generator=g, device="cuda") * 4).to(torch.bfloat16)
    x[0, 7] = 30000.0
    if rows > 2:
        x[1] = 0
        x[2, 11] = float("nan")
    q, s = quantize_rows(x)
    q_ref, s_ref = quantize_rows_torch(x)
    assert torch.equal(s.isnan(), s_ref.isnan()) and torch.equal(s[~s.isnan()], s_ref[~s_ref.isnan()])
    finite = ~s_ref.isnan().flatten()
    assert torch.equal(q[finite].view(torch.uint8), q_ref[finite].view(torch.uint8))
    if rows > 2:
        assert q[2].float().isnan().all()


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize(("n", "k"), SHAPES_8B)
@pytest.mark.parametrize("rows", [1, 4, 64, 256, 1024])
def test_hardware_product_matches_the_emulation_at_8b_shapes(n, k, rows, fast, monkeypatch):
    monkeypatch.setattr(fp8_module, "FAST_ACCUM", fast)
    g = torch.Generator(device="cuda").manual_seed(n + rows)
    w = (torch.randn(n, k, generator=g, device="cuda") / k**0.5).to(torch.bfloat16)
    x = torch.randn(rows, k, generator=g, device="cuda").to(torch.bfloat16)
    layer = Fp8Linear.from_weight(w)
    xq, sx = quantize_rows(x)
    got = fp8_matmul(xq, sx, layer.weight, layer.weight_scale, torch.bfloat16)
    want = fp8_matmul_emulated(xq, sx, layer.weight, layer.weight_scale, torch.bfloat16)
    few = rows <= fp8_module.FP8_GEMV_MAX_ROWS and not fp8_module._tensorwise(rows, n, k)
    exact = few or not fast  # the few-row kernel sums in float32
    assert_within_tolerance(got, want, 2**-7 if exact else 2**-5)


@pytest.mark.parametrize("rows", [2, 200])
def test_the_layer_replays_in_a_cuda_graph_with_new_inputs(rows):
    g = torch.Generator(device="cuda").manual_seed(7)
    layer = Fp8Linear.from_weight((torch.randn(4096, 4096, generator=g, device="cuda") / 64).to(torch.bfloat16))
    x = torch.randn(rows, 4096, generator=g, device="cuda").to(torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        layer(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(x)
    for seed in (1, 2):
        x.copy_(torch.randn(rows, 4096, generator=g.manual_seed(seed), device="cuda").to(torch.bfloat16))
        graph.replay()
        xq, sx = quantize_rows_torch(x)
        want = fp8_matmul_emulated(xq, sx, layer.weight, layer.weight_scale, torch.bfloat16)
        assert_within_tolerance(out, want, 2**-5)


PROMPTS = [[5, 17, 33, 2, 9, 61, 4], [101, 7, 7, 250, 3, 88, 41, 19, 2, 64, 77], [9, 200, 150, 4]]


def _decode(model, **kw) -> list[list[int]]:
    from batchkv.executor import Engine, Request, SamplingParams

    engine = Engine(model, max_seqs=4, capacity=128, device="cuda", **kw)
    ids = [engine.submit(Request(p, SamplingParams(max_new_tokens=12))) for p in PROMPTS]
    tokens: dict[int, list[int]] = {i: [] for i in ids}
    for event in engine.run_until_done():
        tokens[event.request_id].append(event.token)
    engine.close()
    return [tokens[i] for i in ids]


@pytest.fixture(scope="module")
def tiny_fp8():
    from batchkv.models import build_model

    return build_model("sensenova-u1-tiny", "cuda", dtype=torch.bfloat16, seed=0, quantization="fp8")


@pytest.mark.parametrize("overlap", [False, True])
def test_engine_with_graphs_decodes_the_eager_fp8_tokens(tiny_fp8, overlap):
    """The hardware FP8 path under CUDA graphs (overlap on and off) decodes what it decodes eagerly."""
    assert _decode(tiny_fp8, use_graphs=True, overlap=overlap) == _decode(tiny_fp8, use_graphs=False, overlap=False)


def test_first_tokens_on_the_hardware_path_are_the_emulations(tiny_fp8, monkeypatch):
    """Greedy decoding on the hardware path against the emulation: the prompts' first two tokens agree
    (later ones may part where the tiny bf16 model has near-ties: the sums run in another order)."""
    got = _decode(tiny_fp8, use_graphs=True)
    monkeypatch.setattr(fp8_module, "EMULATE", True)
    want = _decode(tiny_fp8, use_graphs=False, overlap=False)
    assert [x[:2] for x in got] == [y[:2] for y in want]


@pytest.mark.parametrize("rows", [1, 5, 256])
def test_fused_norm_and_silu_quantisers_give_the_separate_passes_codes_bit_for_bit(rows):
    from batchkv.models.fused import add_rms_norm, silu_mul

    g = torch.Generator(device="cuda").manual_seed(rows)
    h = (torch.randn(rows, 4096, generator=g, device="cuda") * 4).to(torch.bfloat16)
    d = torch.randn(rows, 4096, generator=g, device="cuda").to(torch.bfloat16)
    w = torch.randn(4096, generator=g, device="cuda").to(torch.bfloat16)
    buf = torch.full((rows, 2 * 12288 + 64), float("nan"), device="cuda", dtype=torch.bfloat16)  # NaN past the row
    gu = buf[:, : 2 * 12288]
    gu.copy_(torch.randn(rows, 2 * 12288, generator=g, device="cuda") * 3)
    if rows > 2:
        d[1, 9] = float("nan")
        gu[2] = 0
    h_sep, x_sep = add_rms_norm(h, d, w, 1e-6)
    h_out, fused = producers.add_rms_norm_quant(h, d, w, 1e-6)
    assert torch.equal(h_out.isnan(), h_sep.isnan()) and torch.equal(h_out.nan_to_num(), h_sep.nan_to_num())
    pairs = [(fused, quantize_rows(x_sep)), (producers.silu_mul_quant(gu), quantize_rows(silu_mul(gu.contiguous())))]
    for (q, s), (q_ref, s_ref) in pairs:
        assert torch.equal(s.isnan(), s_ref.isnan()) and torch.equal(s.nan_to_num(), s_ref.nan_to_num())
        finite = ~s_ref.isnan().flatten()
        assert torch.equal(q[finite].view(torch.uint8), q_ref[finite].view(torch.uint8))


@pytest.mark.parametrize(("n", "k"), SHAPES_8B)
@pytest.mark.parametrize("rows", [1, 64, 200, 256, 1024])
def test_the_unscaled_gemm_with_scales_applied_after_matches_the_emulation(n, k, rows, monkeypatch):
    monkeypatch.setattr(fp8_module, "TENSORWISE", True)
    g = torch.Generator(device="cuda").manual_seed(n + rows)
    w = (torch.randn(n, k, generator=g, device="cuda") / k**0.5).to(torch.bfloat16)
    xq, sx = quantize_rows(torch.randn(rows, k, generator=g, device="cuda").to(torch.bfloat16))
    wq, sw = fp8_module.quantize_weight(w)
    got = fp8_matmul(xq, sx, wq, sw, torch.bfloat16)
    assert_within_tolerance(got, fp8_matmul_emulated(xq, sx, wq, sw, torch.bfloat16), tol=2**-5)  # fast accumulation
