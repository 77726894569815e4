"""transformers' Llama-form decoder layers with the residual adds inside the norm kernels and the FP8
codes written by the norms (`batchkv.models.hf_layers`): the same bits as transformers' own forward in
float32 on the CPU, the same logits as the FP8 layers quantising for themselves (the emulation, and every
kernel under the Triton interpreter), the merged norm kernel's codes against the separate passes'."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
pytest.importorskip("triton")

from batchkv.models import fused as fused_module  # noqa: E402
from batchkv.models import hf_layers, hf_norms  # noqa: E402
from batchkv.models.hf import HFModel, quantize_decoder  # noqa: E402
from batchkv.models.hf_layers import fuse_layers  # noqa: E402
from batchkv.models.hf_norms import FusedRMSNorm, NormForm, residual_rms_norm  # noqa: E402
from batchkv.models.quant import fp8 as fp8_module  # noqa: E402
from batchkv.models.quant import producers  # noqa: E402
from batchkv.models.quant.fp8 import MIN_ACT_SCALE, quantize_rows  # noqa: E402
from tests.model_loop import make_cache, run_step, text_idx  # noqa: E402
from tests.test_model_coverage import ARCHS, build  # noqa: E402

PROMPT = [5, 17, 33, 101, 7, 7, 250, 3, 88, 41]
# model_type: (layers adapted, chained to the next norm, q|k|v readers, gate|up readers) of the 2-layer models
ADAPTED = {"llama": (2, 2, 2, 2), "qwen2": (2, 2, 2, 2), "qwen3": (2, 2, 2, 2), "mistral": (2, 2, 2, 2),
           "gemma": (0, 0, 0, 0), "smollm3": (2, 2, 0, 2), "deepseek_v3": (2, 2, 0, 1), "qwen3_moe": (2, 2, 2, 0),
           "gemma2": (0, 0, 0, 0), "olmo2": (0, 0, 0, 0), "phi3": (0, 0, 0, 0)}  # fmt: skip
FORMS = [NormForm("variance_epsilon", 0.0, True), NormForm("eps", 1.0, False), NormForm("variance_epsilon", 0.0, False)]


def _arch(model_type: str):
    return next(a for a in ARCHS if a.model_type == model_type and a.refusal is None)


def _reader(layer: nn.Module, norm: str) -> bool:
    return getattr(getattr(layer, norm, None), "reader", None) is not None


def step_logits(model: HFModel) -> torch.Tensor:
    """float32 [len(PROMPT), vocab]: one packed prefill step of PROMPT through the model and a cache."""
    cache = make_cache(model, max_seqs=1, max_write=len(PROMPT))
    return run_step(model, cache, [(cache.seq_new(), PROMPT, text_idx(0, len(PROMPT)))], len(PROMPT))


@pytest.mark.parametrize("model_type", list(ADAPTED))
def test_the_adapted_layers_give_transformers_logits_bit_for_bit_in_float32(model_type):
    hf = build(_arch(model_type))
    want = step_logits(HFModel(copy.deepcopy(hf), fuse=False))
    model = HFModel(hf)
    layers = hf.model.layers
    counts = {"layers": sum("forward" in layer.__dict__ for layer in layers),
              "ahead": sum("_norm_ahead" in layer.__dict__ for layer in layers),
              "qkv_reader": sum(_reader(layer, "input_layernorm") for layer in layers),
              "gate_up_reader": sum(_reader(layer, "post_attention_layernorm") for layer in layers)}  # fmt: skip
    assert tuple(counts.values()) == ADAPTED[model_type]
    assert torch.equal(step_logits(model), want)
    assert fuse_layers(hf)["layers"] == 0  # adapted layers have a forward of their own: left alone


def test_the_next_norm_takes_the_sum_made_ahead_only_if_it_is_that_tensor_unchanged():
    norm = FusedRMSNorm(nn.Parameter(torch.randn(8)), 1e-6, FORMS[0], "LlamaRMSNorm")
    g = torch.Generator().manual_seed(1)
    residual, delta = torch.randn(3, 8, generator=g), torch.randn(3, 8, generator=g)
    h = norm.add_ahead(residual, delta)
    assert torch.equal(h, residual + delta)
    assert torch.equal(norm(h), fused_module.rms_norm_torch(h, norm.weight, 1e-6))  # taken as made
    h = norm.add_ahead(residual, delta)
    other = h.clone()
    assert torch.equal(norm(other), fused_module.rms_norm_torch(other, norm.weight, 1e-6)) and norm._ahead is None
    h = norm.add_ahead(residual, delta)
    h.mul_(2)  # changed in place after the sum was normed: computed anew
    assert torch.equal(norm(h), fused_module.rms_norm_torch(h, norm.weight, 1e-6))


def test_a_hook_on_a_layer_sees_the_sum_and_a_changed_sum_is_normed_anew():
    hf = build(_arch("llama"))
    plain = copy.deepcopy(hf)
    model = HFModel(hf)
    for m in (hf, plain):  # a hook that changes the layer's output in place, as a steering adapter might
        m.model.layers[0].register_forward_hook(lambda module, args, out: out.mul_(1.5))
    assert torch.equal(step_logits(model), step_logits(HFModel(plain, fuse=False)))


def test_a_decoder_that_does_more_between_layers_is_not_chained():
    hf = build(_arch("llama"))

    class Scaled(type(hf.model)):
        def forward(self, input_ids=None, **kwargs):  # the loop body is not the layer call alone
            hidden_states = self.embed_tokens(input_ids)
            for decoder_layer in self.layers[: self.config.num_hidden_layers]:
                hidden_states = decoder_layer(hidden_states, **kwargs)
                hidden_states = hidden_states * 1.0
            hidden_states = self.norm(hidden_states)
            return hidden_states

    hf.model.__class__ = Scaled
    assert hf_layers.fuse_decoder(hf) == {"layers": 2, "ahead": 0, "qkv_reader": 2, "gate_up_reader": 2}
    assert not any("_norm_ahead" in layer.__dict__ for layer in hf.model.layers)


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_fp8_with_the_codes_from_the_norms_equals_the_layers_quantising_for_themselves(model_type, monkeypatch):
    hf = build(_arch(model_type)).to(torch.bfloat16)
    quantize_decoder(hf)
    want = step_logits(HFModel(copy.deepcopy(hf), fuse=False))
    model = HFModel(hf)
    calls = []
    separate = fp8_module.quantize_rows  # the layers' own quantiser (the producers hold their own name for it)
    monkeypatch.setattr(fp8_module, "quantize_rows", lambda x, **kw: calls.append(x.shape) or separate(x, **kw))
    outs = {}
    for quant in (False, True):
        monkeypatch.setattr(hf_norms, "QUANT", quant)
        calls.clear()
        outs[quant] = step_logits(model)
        outs[f"calls_{quant}"] = len(calls)
    assert torch.equal(outs[False], want) and torch.equal(outs[True], want)  # the emulation: the same codes
    assert (outs["calls_False"], outs["calls_True"]) == (4 * 2, 2 * 2)  # o and down quantise; q|k|v, gate|up not


def test_every_kernel_under_the_interpreter_gives_the_fp8_logits_of_the_separate_quantiser(monkeypatch):
    hf = build(_arch("llama")).to(torch.bfloat16)
    quantize_decoder(hf)
    model = HFModel(hf)
    # Every kernel through the interpreter in both runs (its e4m3 conversion is not torch's): the norms with
    # the residual adds, RoPE, SiLU-mul and the quantiser launches apart, or the codes from the norms.
    monkeypatch.setattr(fused_module, "_use_triton", lambda x, force: force is not False)
    separate = fp8_module.quantize_rows
    monkeypatch.setattr(fp8_module, "quantize_rows", lambda x, **kw: separate(x, triton_kernel=True))
    monkeypatch.setattr(producers, "quantize_rows", lambda x, **kw: separate(x, triton_kernel=True))
    outs = []
    for fused in (False, True):
        monkeypatch.setattr(producers, "fused", lambda x, fused=fused: fused)
        outs.append(step_logits(model))
    assert torch.isfinite(outs[1]).all()
    assert torch.equal(outs[0], outs[1])


def _poisoned(rows: int, n: int, dtype: torch.dtype, g: torch.Generator, scale: float = 3.0) -> torch.Tensor:
    """[rows, n] inside a buffer whose rows before and after are NaN (a read past the rows shows)."""
    buf = torch.full((rows + 2, n), float("nan"), dtype=dtype)
    buf[1:-1] = (torch.randn(rows, n, generator=g) * scale).to(dtype)
    return buf[1:-1]


@pytest.mark.parametrize("form", FORMS, ids=["llama", "gemma", "olmo2"])
@pytest.mark.parametrize(("n", "weight_dtype"), [(96, torch.bfloat16), (16, torch.float32), (96, torch.float32)])
@pytest.mark.parametrize("add", [False, True])
def test_the_norm_kernel_writes_the_separate_quantisers_codes_under_the_interpreter(form, n, weight_dtype, add):
    g = torch.Generator().manual_seed(n)
    rows = 13  # 16-wide rows: 13 rows over programs of 16 (one ragged), 96-wide: of 8
    x, delta = _poisoned(rows, n, torch.bfloat16, g), _poisoned(rows, n, torch.bfloat16, g, 1.0)
    weight = torch.randn(n, generator=g).to(weight_dtype)
    x[2, 5] = float("nan")
    x[3], delta[3] = 1.0, -1.0  # a row of zeros (after the add)
    kw = {"offset": form.offset, "round_first": form.round_first}
    h, out, (q, s) = producers.rms_norm_quant(x, weight, 1e-6, delta=delta if add else None, triton_kernel=True, **kw)
    if add:
        h_ref, out_ref = residual_rms_norm(x, delta, weight, 1e-6, triton_kernel=True, **kw)
    else:
        h_ref, out_ref = x, fused_module.rms_norm(x, weight, 1e-6, triton_kernel=True, **kw)
    q_ref, s_ref = quantize_rows(out_ref, triton_kernel=True)  # codes: the interpreter's own e4m3 conversion
    for got, want in ((h, h_ref), (out, out_ref), (s, s_ref)):
        torch.testing.assert_close(got, want, equal_nan=True, rtol=0, atol=0)
    finite = ~s_ref.isnan().flatten()
    assert torch.equal(q[finite].view(torch.uint8), q_ref[finite].view(torch.uint8)) and s[2].isnan()
    if add:
        assert s[3] == MIN_ACT_SCALE
    torch_h, torch_out = (residual_rms_norm(x, delta, weight, 1e-6, triton_kernel=False, **kw) if add else
                          (x, fused_module.rms_norm_torch(x, weight, 1e-6, **kw)))  # fmt: skip
    # against torch's ops: the interpreter rounds to bf16 its own way (the GPU test has them bit for bit)
    torch.testing.assert_close(h, torch_h, equal_nan=True, rtol=2**-7, atol=0)
    torch.testing.assert_close(out, torch_out, equal_nan=True, rtol=2**-5, atol=1e-5)


def test_with_fuse_off_or_the_switch_off_the_layers_are_left_alone(monkeypatch):
    hf = build(_arch("llama"))
    HFModel(hf, fuse=False)
    assert not any("forward" in layer.__dict__ for layer in hf.model.layers)
    monkeypatch.setattr(hf_layers, "FUSE", False)
    HFModel(hf)
    assert not any("forward" in layer.__dict__ for layer in hf.model.layers)
    assert isinstance(hf.model.layers[0].input_layernorm, FusedRMSNorm)  # the other fusions still made


def test_a_tensor_parallel_ranks_norm_gives_its_own_fp8_slices_the_codes_they_would_make(tmp_path, monkeypatch):
    from batchkv.models.loading import load_hf_shard
    from batchkv.models.parallel import Shard
    from tests.tp_helpers import save_qwen3

    save_qwen3(tmp_path)
    hf = load_hf_shard(tmp_path, Shard(1, 2), dtype=torch.bfloat16, quantization="fp8").hf
    layer, cfg = hf.model.layers[1], hf.config
    attn, norm = layer.self_attn, layer.input_layernorm
    assert norm.reader is attn.fused_qkv and attn.q_proj.out_features == cfg.num_attention_heads // 2 * cfg.head_dim
    x = torch.randn(1, 5, norm.weight.shape[0], generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    outs, claimed = [], []
    for quant in (False, True):
        monkeypatch.setattr(hf_norms, "QUANT", quant)
        normed = norm(x)
        claimed.append(attn.fused_qkv._given is not None)
        outs.append([attn.q_proj(normed), attn.k_proj(normed), attn.v_proj(normed)])  # this rank's heads
    assert claimed == [False, True]
    assert all(torch.equal(a, b) for a, b in zip(*outs, strict=True))


def test_a_norm_shared_between_layers_gets_no_reader_and_changes_nothing(monkeypatch):
    hf = build(_arch("llama")).to(torch.bfloat16)
    hf.model.layers[1].input_layernorm = hf.model.layers[0].input_layernorm  # one module in two places
    quantize_decoder(hf)
    want = step_logits(HFModel(copy.deepcopy(hf), fuse=False))
    model = HFModel(hf)
    assert hf.model.layers[1].input_layernorm is hf.model.layers[0].input_layernorm
    assert [_reader(layer, name) for layer in hf.model.layers for name in ("input_layernorm",
            "post_attention_layernorm")] == [False, True, False, True]  # fmt: skip
    monkeypatch.setattr(hf_norms, "QUANT", True)
    assert torch.equal(step_logits(model), want)


def _in_place(_module, args, out=None) -> None:
    (args[0] if out is None else out).mul_(3.0)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("where", ["norm forward hook", "mlp pre-hook"])
def test_a_hook_that_changes_a_norms_output_in_place_is_seen_by_its_fp8_reader(mode, where, monkeypatch):
    """Inference tensors keep no version counter: there the norm's codes are never handed over."""
    hf = build(_arch("llama")).to(torch.bfloat16)
    quantize_decoder(hf)
    reference, model = HFModel(copy.deepcopy(hf), fuse=False), HFModel(hf)
    monkeypatch.setattr(hf_norms, "QUANT", True)
    for m in (reference, model):
        layer = m.hf.model.layers[0]
        if where == "mlp pre-hook":
            layer.mlp.register_forward_pre_hook(_in_place)
        else:
            layer.input_layernorm.register_forward_hook(_in_place)
    with torch.inference_mode() if mode == "inference_mode" else torch.no_grad():
        want, got = step_logits(reference), step_logits(model)
    assert torch.equal(got, want)
