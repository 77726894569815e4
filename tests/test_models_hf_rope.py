"""Llama attention's RoPE as one kernel (batchkv.models.hf_rope), against transformers' apply_rotary_pos_emb."""

from __future__ import annotations

import functools

import pytest
import torch

from tests.model_loop import greedy_through_cache

transformers = pytest.importorskip("transformers")
pytest.importorskip("triton")

from transformers.models.llama import modeling_llama  # noqa: E402

from batchkv.models import fused, hf_norms, hf_rope  # noqa: E402
from batchkv.models.hf import HFModel  # noqa: E402
from batchkv.models.hf_rope import fuse_rope, rope_form  # noqa: E402
from tests.test_models_hf_norms import GEOMETRY, MAX_NEW, PROMPTS, _hf_greedy, _peaky  # noqa: E402


def _projected(w: int, heads: int, d: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """[1, heads, w, d]: a projection's [1, w, heads, d] transposed, inside NaN rows of storage."""
    buf = torch.full((w + 2, heads * d), float("nan"), dtype=dtype)
    buf[1:-1] = torch.randn(w, heads * d, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return buf[1:-1].view(1, w, heads, d).transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("q_heads", "kv_heads", "d"), [(4, 2, 16), (9, 3, 64)])  # (9, 3): SmolLM2's heads
def test_the_rope_kernel_gives_transformers_apply_rotary_pos_emb(dtype, q_heads, kv_heads, d):
    w = 5
    q, k = _projected(w, q_heads, d, dtype, 1), _projected(w, kv_heads, d, dtype, 2)
    config = transformers.LlamaConfig(head_dim=d, hidden_size=q_heads * d, num_attention_heads=q_heads)
    rotary = modeling_llama.LlamaRotaryEmbedding(config)
    cos, sin = rotary(q, torch.tensor([[0, 3, 17, 100, 1000]]))
    assert cos.dtype == dtype
    want = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    got = fused.rope_qk(q, k, cos, sin, triton_kernel=True)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert a.transpose(1, 2).is_contiguous()  # [1, W, H, D] in memory: the attention's view needs no copy
        if dtype == torch.float32:  # the same products and sum as torch's ops
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        else:  # the interpreter's bf16 casts round otherwise than torch's: a bf16 ulp
            torch.testing.assert_close(a, b, rtol=2**-7, atol=2**-7 * b.abs().max().item())


def test_the_rule_adapts_llamas_qwen2s_mistrals_and_qwen3s_attention_and_not_olmo2s():
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**GEOMETRY))
    qwen2 = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**GEOMETRY))
    mistral = transformers.MistralForCausalLM(transformers.MistralConfig(**GEOMETRY))
    qwen3 = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**GEOMETRY))
    cache = rope_form(llama.model.layers[0].self_attn)[0]
    assert cache in ("cache", "past_key_values")  # transformers 5.24's name, 5.17's
    olmo2 = transformers.Olmo2ForCausalLM(transformers.Olmo2Config(**GEOMETRY))
    assert rope_form(llama.model.layers[0].self_attn) == (cache, None, False)
    assert rope_form(qwen2.model.layers[0].self_attn) == (cache, "module", False)  # the window passed on
    assert rope_form(mistral.model.layers[0].self_attn) == (cache, "config", False)
    assert rope_form(qwen3.model.layers[0].self_attn) == (cache, "module", True)  # q/k normed per head first
    assert rope_form(olmo2.model.layers[0].self_attn) is None  # q/k normed over all heads: another forward
    assert fuse_rope(llama) == GEOMETRY["num_hidden_layers"]
    assert fuse_rope(llama) == 0  # adapted modules have a forward of their own: left alone


@pytest.mark.parametrize("name", ["qwen2", "mistral", "qwen3"])
def test_the_adapted_forward_gives_the_class_forwards_logits_with_a_sliding_window(name):
    window = {"use_sliding_window": True}
    make = {"qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, window),
            "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {}),
            "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, window)}[name]  # fmt: skip
    config = make[0](**GEOMETRY, sliding_window=3, max_window_layers=0, attn_implementation="eager", **make[2])
    hf = _peaky(make[1](config), seed=5)
    ids = torch.tensor([[5, 17, 33, 101, 7, 250, 3, 88]])  # past the window of 3
    with torch.no_grad():
        want = hf(input_ids=ids, use_cache=False).logits
        assert fuse_rope(hf) == GEOMETRY["num_hidden_layers"]
        got = hf(input_ids=ids, use_cache=False).logits
    assert torch.equal(got, want)


@pytest.mark.parametrize("name", ["llama", "granite", "qwen2", "qwen3"])
def test_greedy_tokens_with_the_rope_and_norm_kernels_equal_transformers_generate(name, monkeypatch):
    make = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
            "granite": (transformers.GraniteConfig, transformers.GraniteForCausalLM),
            "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
            "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[name]  # fmt: skip
    hf = _peaky(make[1](make[0](**GEOMETRY)), seed=3)
    want = [_hf_greedy(hf, prompt, n) for prompt, n in zip(PROMPTS, MAX_NEW, strict=True)]
    model = HFModel(hf)
    assert all("forward" in layer.self_attn.__dict__ for layer in hf.model.layers)
    monkeypatch.setattr(hf_rope, "rope_qk", functools.partial(fused.rope_qk, triton_kernel=True))
    monkeypatch.setattr(hf_norms, "rms_norm", functools.partial(fused.rms_norm, triton_kernel=True))
    assert greedy_through_cache(model, PROMPTS, MAX_NEW, max_write=4, bucket=4) == want
    # the wrapped model on its own: generate passes a transformers cache, which takes the class's forward
    assert [_hf_greedy(hf, prompt, n) for prompt, n in zip(PROMPTS, MAX_NEW, strict=True)] == want


def test_with_fuse_off_hfmodel_leaves_the_attention_alone(monkeypatch):
    monkeypatch.setattr(hf_rope, "FUSE", False)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**GEOMETRY))
    HFModel(hf)
    assert not any("forward" in layer.self_attn.__dict__ for layer in hf.model.layers)


def test_a_kernels_hub_wrapper_reads_as_the_function_it_stands_for():
    # With the `kernels` package installed, transformers (5.25) makes `apply_rotary_pos_emb` an nn.Module
    # ("Func") that calls the function unless the model was kernelized: the rule reads the function
    hub = pytest.importorskip("transformers.integrations.hub_kernels")

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        cos = cos.unsqueeze(unsqueeze_dim)
        sin = sin.unsqueeze(unsqueeze_dim)
        q_embed = (q * cos) + (modeling_llama.rotate_half(q) * sin)
        k_embed = (k * cos) + (modeling_llama.rotate_half(k) * sin)
        return q_embed, k_embed

    wrapped = hub.use_kernel_forward_from_hub("rotary_pos_emb")(apply_rotary_pos_emb)
    if wrapped is apply_rotary_pos_emb:
        pytest.skip("no `kernels` package: transformers leaves the function as it is")
    assert isinstance(wrapped, torch.nn.Module) and hf_norms.hub_wrapped(wrapped) is apply_rotary_pos_emb
    assert hf_norms.function_source(wrapped) == hf_norms.function_source(apply_rotary_pos_emb) != ""
    linear = torch.nn.Linear(2, 2)
    assert hf_norms.hub_wrapped(linear) is linear  # another module is itself
