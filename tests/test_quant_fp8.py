"""FP8 compute: e4m3 codes, scales and products against float64 first principles; the layer in models."""

from __future__ import annotations

import math

import pytest
import torch

from batchkv.errors import CheckpointError, ConfigError
from batchkv.models import build_model, save_checkpoint
from batchkv.models.quant import (
    Fp8Linear,
    fp8_matmul_emulated,
    producers,
    quantize_layers,
    quantize_rows,
    quantize_weight,
)
from batchkv.models.quant import fp8 as fp8_module
from batchkv.models.quant.fp8 import MIN_ACT_SCALE, quantize_rows_torch
from tests.model_loop import greedy_through_cache, make_cache, run_step, text_idx


def e4m3_grid() -> torch.Tensor:
    """Every finite e4m3fn value as float64, from its definition (1 sign, 4 exponent bits of bias 7,
    3 mantissa bits, subnormals at exponent 0, S.1111.111 the only NaN): 0, +-2^-9 ... +-448."""
    values = set()
    for e in range(16):
        for m in range(8):
            if e == 15 and m == 7:
                continue  # NaN
            v = (m / 8) * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
            values |= {v, -v}
    return torch.tensor(sorted(values), dtype=torch.float64)


def nearest_e4m3(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Round float64 `v` to the nearest e4m3 value (ties to the even mantissa); also a mask of the
    values that lie within 2^-20 (relative) of a tie but not on it, where float32 division may round either way."""
    grid = e4m3_grid()
    idx = torch.searchsorted(grid, v.clamp(-448, 448)).clamp(1, len(grid) - 1)
    lo, hi = grid[idx - 1], grid[idx]
    dlo, dhi = (v - lo).abs(), (hi - v).abs()
    even_hi = (hi.abs() * 2.0 ** (-torch.floor(torch.log2(hi.abs().clamp_min(2.0**-9)))) * 8).round() % 2 == 0
    pick = torch.where(dlo < dhi, lo, torch.where(dhi < dlo, hi, torch.where(even_hi, hi, lo)))
    gap = (dlo - dhi).abs()
    near_tie = (gap > 0) & (gap <= v.abs() * 2.0**-20)  # an exact tie must round to even
    return pick, near_tie


def test_weight_codes_and_scales_match_a_float64_computation_from_the_definition():
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(40, 96, generator=g) * torch.logspace(-3, 2, 40)[:, None]).to(torch.bfloat16)
    w[7] = 0  # a row of zeros
    codes, scale = quantize_weight(w)
    w64 = w.double()
    amax = w64.abs().amax(dim=1)
    want_scale = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
    torch.testing.assert_close(scale.double(), want_scale, rtol=2**-23, atol=0)  # amax times float32(1/448)
    want_codes, near_tie = nearest_e4m3(w64 / scale.double()[:, None])
    ok = (codes.double() == want_codes) | near_tie
    assert ok.all() and near_tie.float().mean() < 0.01
    assert codes.double().abs().max() == 448  # each row's largest weight takes the largest code
    assert (codes[7].double() == 0).all() and scale[7] == 1


def test_activation_codes_and_the_emulated_product_match_float64():
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(6, 96, generator=g) * 5).to(torch.bfloat16)
    w = torch.randn(32, 96, generator=g).to(torch.bfloat16)
    xq, sx = quantize_rows_torch(x)
    wq, sw = quantize_weight(w)
    want_sx = (x.double().abs().amax(dim=1, keepdim=True) / 448).clamp_min(MIN_ACT_SCALE)
    torch.testing.assert_close(sx.double(), want_sx, rtol=2**-23, atol=0)
    want_codes, near_tie = nearest_e4m3(x.double() / sx.double())
    assert ((xq.double() == want_codes) | near_tie).all()
    y = fp8_matmul_emulated(xq, sx, wq, sw, torch.bfloat16)
    exact = (xq.double() @ wq.double().T) * sx.double() * sw.double()[None, :]  # float64 sum of exact products
    torch.testing.assert_close(y.double(), exact, rtol=2**-8, atol=1e-6)  # one bf16 rounding
    reference = x.double() @ w.double().T  # and the quantisation error against the float product is small
    assert ((y.double() - reference).norm() / reference.norm()) < 0.05


def test_per_token_scales_on_zero_rows_huge_values_nan_and_inf():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 64, generator=g).to(torch.bfloat16)
    x[1] = 0
    x[2] *= 1e30  # huge but finite in bf16
    x[3, 5] = float("nan")
    x[4, 9] = float("inf")
    w = torch.randn(16, 64, generator=g).to(torch.bfloat16)
    xq, sx = quantize_rows_torch(x)
    assert sx[1] == MIN_ACT_SCALE and (xq[1].float() == 0).all()
    assert torch.isfinite(sx[2]) and xq[2].float().abs().max() == 448
    assert sx[3].isnan() and sx[4].isinf()
    y = Fp8Linear.from_weight(w)(x)
    assert (y[1] == 0).all()
    ref = x[2].double() @ w.double().T
    assert ((y[2].double() - ref).norm() / ref.norm()) < 0.05  # scaled right, no overflow
    assert y[3].isnan().all() and y[4].isnan().all()  # a NaN or an infinity stays visible in its own row
    assert torch.isfinite(y[[0, 1, 2]]).all()


def test_a_nan_weight_makes_its_output_channel_nan():
    w = torch.randn(16, 32)
    w[3, 4] = float("nan")
    y = Fp8Linear.from_weight(w)(torch.randn(2, 32))
    assert y[:, 3].isnan().all() and not y[:, [0, 1, 2, 4]].isnan().any()


def test_the_layer_keeps_leading_dims_bias_reduce_and_silu_mul():
    g = torch.Generator().manual_seed(3)
    lin = torch.nn.Linear(32, 16, bias=True, dtype=torch.bfloat16)
    layer = Fp8Linear.from_linear(lin)
    x = torch.randn(1, 3, 32, generator=g).to(torch.bfloat16)
    xq, sx = quantize_rows_torch(x[0])
    product = fp8_matmul_emulated(xq, sx, layer.weight, layer.weight_scale, torch.bfloat16)
    assert torch.equal(layer(x)[0], product + lin.bias.detach())
    doubled = Fp8Linear.from_weight(lin.weight, lin.bias, reduce=lambda y: 2 * y)  # as an all-reduce of 2 ranks
    assert torch.equal(doubled(x)[0], 2 * product + lin.bias.detach())
    gate_up = torch.randn(3, 64, generator=g).to(torch.bfloat16)
    act = torch.nn.functional.silu(gate_up[:, :32]) * gate_up[:, 32:]
    assert torch.equal(layer(gate_up, silu_mul=True, out_dtype=torch.float32), layer(act).float())


@pytest.fixture(scope="module")
def sensenova_pair():
    float_model = build_model("sensenova-u1-tiny", "cpu", seed=0)
    fp8_model = build_model("sensenova-u1-tiny", "cpu", seed=0, quantization="fp8")
    return float_model, fp8_model


def test_build_model_fp8_replaces_every_projection_and_keeps_embedding_and_head(sensenova_pair):
    float_model, fp8_model = sensenova_pair
    for layer in fp8_model.layers:
        for name in ("qkv", "o_proj", "gate_up", "down"):
            assert isinstance(getattr(layer, name), Fp8Linear)
    assert fp8_model.lm_head.dtype == float_model.lm_head.dtype and fp8_model.quantization == "fp8"
    codes, scale = quantize_weight(float_model.layers[1].gate_up)
    assert torch.equal(fp8_model.layers[1].gate_up.weight.view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(fp8_model.layers[1].gate_up.weight_scale, scale)


def test_sensenova_fp8_logits_are_the_emulation_and_close_to_the_float_model(sensenova_pair):
    float_model, fp8_model = sensenova_pair
    prompts = [[5, 17, 33, 2, 9], [101, 7, 7, 250, 3, 88, 41]]
    outs = []
    for model in (float_model, fp8_model):
        cache = make_cache(model, max_seqs=2)
        a, b = cache.seq_new(), cache.seq_new()
        chunks = [(a, prompts[0], text_idx(0, 5)), (b, prompts[1], text_idx(0, 7))]
        outs.append(run_step(model, cache, chunks, 16))
    want, got = outs
    assert torch.isfinite(got).all()
    assert ((got - want).norm() / want.norm()) < 0.1
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean()
    assert agree >= 0.8


def test_saving_a_quantised_sensenova_model_is_refused(sensenova_pair, tmp_path):
    with pytest.raises(CheckpointError):
        save_checkpoint(sensenova_pair[1], tmp_path / "x.safetensors")


def test_an_unknown_quantization_is_refused_by_build_model():
    with pytest.raises(ConfigError):
        build_model("sensenova-u1-tiny", "cpu", quantization="int4")


def test_quantize_layers_leaves_norms_and_other_attributes_alone():
    module = torch.nn.Module()
    module.proj = torch.nn.Linear(16, 16)
    module.norm = torch.nn.Parameter(torch.ones(16))
    module.mat = torch.nn.Parameter(torch.randn(16, 16))
    assert quantize_layers(module, ("proj", "norm", "mat", "absent")) == 2
    assert isinstance(module.proj, Fp8Linear) and isinstance(module.mat, Fp8Linear)
    assert isinstance(module.norm, torch.nn.Parameter)


transformers = pytest.importorskip("transformers")


def _tiny_qwen3() -> torch.nn.Module:
    from tests.test_models_hf import _qwen3

    return _qwen3()


def test_hf_fp8_decoder_through_the_cache_equals_its_own_forward():
    from batchkv.models.hf import HFModel, quantize_decoder

    hf = _tiny_qwen3()
    assert quantize_decoder(hf) == 3 * 7
    assert isinstance(hf.model.layers[0].self_attn.q_proj, Fp8Linear)
    assert isinstance(hf.lm_head, torch.nn.Linear) and not isinstance(hf.lm_head, Fp8Linear)
    model = HFModel(hf)
    prompt = [5, 17, 33, 2, 9, 61, 4]
    cache = make_cache(model, max_seqs=1)
    seq = cache.seq_new()
    got = run_step(model, cache, [(seq, prompt, text_idx(0, 7))], 8)
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0].float()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    tokens = greedy_through_cache(model, [prompt], [6])[0]
    assert len(tokens) == 6


def test_quantize_rows_kernel_gives_the_torch_scales_under_the_interpreter():
    pytest.importorskip("triton")
    x = (torch.randn(4, 96, generator=torch.Generator().manual_seed(4)) * 3).to(torch.bfloat16)
    x[1] = 0
    x[2, 3] = float("nan")
    want = quantize_rows_torch(x)[1]
    got = quantize_rows(x, triton_kernel=True)[1]  # codes: the interpreter's e4m3 conversion is not the GPU's
    torch.testing.assert_close(got, want, equal_nan=True, rtol=0, atol=0)


def test_fp8_gemv_kernel_matches_the_emulation_under_the_interpreter():
    pytest.importorskip("triton")
    g = torch.Generator().manual_seed(5)
    xq, sx = quantize_rows_torch((torch.randn(3, 96, generator=g) * 3).to(torch.bfloat16))
    wq, sw = quantize_weight(torch.randn(48, 96, generator=g))
    got = fp8_module.fp8_gemv(xq, sx, wq, sw, torch.bfloat16)
    want = fp8_matmul_emulated(xq, sx, wq, sw, torch.bfloat16)
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=1e-3)  # one bf16 rounding apart
    assert not math.isnan(got.float().sum())


def test_fused_norm_and_silu_quantisers_give_the_separate_passes_codes_under_the_interpreter():
    pytest.importorskip("triton")
    from batchkv.models.fused import add_rms_norm, silu_mul

    g = torch.Generator().manual_seed(6)
    h = (torch.randn(4, 96, generator=g) * 3).to(torch.bfloat16)
    d = torch.randn(4, 96, generator=g).to(torch.bfloat16)
    w = torch.randn(96, generator=g).to(torch.bfloat16)
    d[2, 5], d[3] = float("nan"), -h[3]  # a NaN row; a row of zeros
    h_sep, x_sep = add_rms_norm(h, d, w, 1e-6, triton_kernel=True)
    h_out, (q, s) = producers.add_rms_norm_quant(h, d, w, 1e-6, triton_kernel=True)
    q_ref, s_ref = quantize_rows(x_sep, triton_kernel=True)  # codes: the interpreter's own e4m3 conversion
    torch.testing.assert_close(h_out, h_sep, equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(s, s_ref, equal_nan=True, rtol=0, atol=0)
    assert torch.equal(q[[0, 1, 3]].view(torch.uint8), q_ref[[0, 1, 3]].view(torch.uint8)) and s[3] == MIN_ACT_SCALE
    buf = torch.full((3, 2 * 100 + 24), float("nan"), dtype=torch.bfloat16)  # NaN past each row's gate | up
    buf[:, :200] = torch.randn(3, 200, generator=g) * 4
    buf[1, :200], buf[2, 150] = 0, float("nan")  # a row of zeros; a NaN in a row's up half
    q_ref, s_ref = quantize_rows(silu_mul(buf[:, :200].contiguous(), triton_kernel=True), triton_kernel=True)
    for block in (16, 128):  # many chunks a row, and one
        producers.SILU_QUANT_BLOCK, saved = block, producers.SILU_QUANT_BLOCK
        try:
            q, s = producers.silu_mul_quant(buf[:, :200], triton_kernel=True)
        finally:
            producers.SILU_QUANT_BLOCK = saved
        torch.testing.assert_close(s, s_ref, equal_nan=True, rtol=0, atol=0)
        assert s[2].isnan() and torch.equal(q[:2].view(torch.uint8), q_ref[:2].view(torch.uint8))


def test_sensenova_fp8_step_with_the_quantisers_fused_into_norm_and_silu_gives_the_same_logits(
    sensenova_pair, monkeypatch
):
    pytest.importorskip("triton")
    import batchkv.models.fused as fused_module

    fp8_model = sensenova_pair[1]
    # Every kernel through the interpreter in both runs (its e4m3 conversion is not torch's): the norm,
    # SiLU-mul and quantiser launches apart, or fused (Fp8Rows into the layers).
    monkeypatch.setattr(fused_module, "_use_triton", lambda x, force: force is not False)
    separate_quantiser = fp8_module.quantize_rows
    monkeypatch.setattr(fp8_module, "quantize_rows", lambda x: separate_quantiser(x, triton_kernel=True))
    outs = []
    for fused in (False, True):
        monkeypatch.setattr(producers, "fused", lambda x, fused=fused: fused)
        cache = make_cache(fp8_model, max_seqs=1)
        outs.append(run_step(fp8_model, cache, [(cache.seq_new(), [101, 7, 250], text_idx(0, 3))], 4))
    separate, fused = outs
    assert torch.isfinite(fused).all()
    assert torch.equal(fused, separate)


def test_apply_scales_kernel_is_the_emulations_epilogue_under_the_interpreter():
    pytest.importorskip("triton")
    g = torch.Generator().manual_seed(8)
    xq, sx = quantize_rows_torch((torch.randn(3, 64, generator=g) * 3).to(torch.bfloat16))
    wq, sw = quantize_weight(torch.randn(40, 64, generator=g))
    sums = xq.float() @ wq.float().T  # what the scalar-scaled GEMM writes (float32, scales of 1)
    got = fp8_module.apply_scales(sums, sx, sw, torch.bfloat16)
    assert torch.equal(fp8_module.apply_scales(sums, sx, sw, torch.float32), sums * sx * sw.reshape(1, -1))
    want = fp8_matmul_emulated(xq, sx, wq, sw, torch.float32)  # the interpreter rounds to bf16 its own way
    torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=0)
