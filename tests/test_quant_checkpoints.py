"""FP8 checkpoints as published: transformers' `fp8` (block-wise, written by transformers' own
quantiser) and compressed-tensors' float-quantized layout load, and decode what quantise-at-load
decodes for the same weights; bad layouts and unknown methods are refused before anything is copied."""

from __future__ import annotations

import json

import pytest
import torch

from batchkv.errors import CheckpointError, ConfigError
from batchkv.models.quant import Fp8Linear, quantize_weight
from batchkv.models.quant.checkpoints import read_scheme
from tests.model_loop import greedy_through_cache, make_cache, run_step, text_idx

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from batchkv.models.hf import HFModel, quantize_decoder  # noqa: E402

# every projection a whole number of 128 x 128 blocks (transformers' quantiser leaves others in float)
GEOMETRY = {"vocab_size": 256, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
            "max_position_embeddings": 256}  # fmt: skip
PROMPT = [5, 17, 33, 2, 9, 61, 4, 88]
FP8_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}
CT_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False},
            "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token",
                                  "dynamic": True},
        }
    },
    "ignore": ["lm_head"],
}  # fmt: skip


def _float_model() -> torch.nn.Module:
    from tests.test_models_hf import _peaky

    cfg = transformers.Qwen3Config(**GEOMETRY, attn_implementation="sdpa", tie_word_embeddings=False)
    return _peaky(transformers.Qwen3ForCausalLM(cfg), seed=3)


def _write(tmp_path, model, tensors: dict, quantization_config: dict):
    model.config.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = quantization_config
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    safetensors_torch.save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_path / "model.safetensors"))
    return tmp_path


def _is_projection(name: str) -> bool:
    return any(f".{p}.weight" in name for p in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                  "down_proj"))  # fmt: skip


def _transformers_fp8_checkpoint(tmp_path, model):
    """The layout transformers' FineGrainedFP8 loader reads, written by its own quantiser (Fp8Quantize)."""
    from types import SimpleNamespace

    from transformers.integrations.finegrained_fp8 import Fp8Quantize
    from transformers.utils.quantization_config import FineGrainedFP8Config

    quantizer = Fp8Quantize(SimpleNamespace(quantization_config=FineGrainedFP8Config(weight_block_size=(128, 128))))
    tensors = {}
    for name, p in model.state_dict().items():
        tensors.update(quantizer.convert({name: p.detach()}) if _is_projection(name) else {name: p.detach()})
    return _write(tmp_path, model, tensors, FP8_CONFIG), tensors


def _logits(model: HFModel) -> torch.Tensor:
    cache = make_cache(model, max_seqs=1)
    seq = cache.seq_new()
    return run_step(model, cache, [(seq, PROMPT, text_idx(0, len(PROMPT)))], 8)


def test_transformers_fp8_block_checkpoint_loads_and_decodes_as_quantise_at_load(tmp_path):
    float_model = _float_model()
    path, tensors = _transformers_fp8_checkpoint(tmp_path, float_model)
    assert tensors["model.layers.0.mlp.down_proj.weight_scale_inv"].shape == (1, 2)  # [128/128, 256/128]
    loaded = HFModel.from_pretrained(path, dtype=torch.float32)
    layer = loaded.hf.model.layers[1].mlp.gate_proj  # the gate rows of the fused gate|up (batchkv.models.hf_fuse)
    assert isinstance(layer.fused.layer, Fp8Linear) and not isinstance(loaded.hf.lm_head, Fp8Linear)
    # The same weights (the checkpoint's, dequantised block by block), quantised at load:
    same = _float_model()
    with torch.no_grad():
        for name, p in same.named_parameters():
            if _is_projection(name):
                scale = tensors[name + "_scale_inv"].repeat_interleave(128, 0)[: p.shape[0]]
                p.copy_(tensors[name].float() * scale.repeat_interleave(128, 1)[:, : p.shape[1]])
    quantize_decoder(same)
    want = same.model.layers[1].mlp.gate_proj
    assert torch.equal(layer.weight.view(torch.uint8), want.weight.view(torch.uint8))
    assert torch.equal(layer.weight_scale, want.weight_scale)
    assert torch.equal(_logits(loaded), _logits(HFModel(same)))
    assert greedy_through_cache(loaded, [PROMPT], [6]) == greedy_through_cache(HFModel(same), [PROMPT], [6])


def test_a_block_checkpoint_decodes_the_same_with_q_k_v_and_gate_up_fused_and_not(tmp_path):
    # block scales are requantised per output channel at load, so a fused group's codes and scales are
    # its projections' own, concatenated (batchkv.models.hf_fuse), and the emulated logits are the same
    path, _ = _transformers_fp8_checkpoint(tmp_path, _float_model())
    fused = HFModel.from_pretrained(path, dtype=torch.float32)
    plain = HFModel.from_pretrained(path, dtype=torch.float32, fuse=False)
    assert isinstance(fused.hf.model.layers[0].self_attn.fused_qkv.layer, Fp8Linear)
    assert isinstance(plain.hf.model.layers[0].self_attn.q_proj, Fp8Linear)
    assert torch.equal(_logits(fused), _logits(plain))


def test_block_requantisation_stays_within_one_e4m3_step_of_the_block_weights(tmp_path):
    float_model = _float_model()
    path, tensors = _transformers_fp8_checkpoint(tmp_path, float_model)
    loaded = HFModel.from_pretrained(path, dtype=torch.float32)
    name = "model.layers.0.self_attn.q_proj.weight"
    scale = tensors[name + "_scale_inv"].repeat_interleave(128, 0).repeat_interleave(128, 1)
    block = tensors[name].float() * scale[: tensors[name].shape[0], : tensors[name].shape[1]]
    layer = loaded.hf.model.layers[0].self_attn.q_proj
    got = layer.weight.float() * layer.weight_scale[:, None]
    assert ((got - block).abs() <= 2**-3 * block.abs() + 2**-9 * layer.weight_scale[:, None]).all()


def test_compressed_tensors_channel_checkpoint_uses_its_codes_as_stored(tmp_path):
    float_model = _float_model()
    tensors = {}
    for name, p in float_model.state_dict().items():
        if _is_projection(name):
            codes, scale = quantize_weight(p)
            tensors[name], tensors[name + "_scale"] = codes, scale[:, None]  # weight_scale [N, 1]
        else:
            tensors[name] = p.detach()
    path = _write(tmp_path, float_model, tensors, CT_CONFIG)
    loaded = HFModel.from_pretrained(path, dtype=torch.float32)
    quantize_decoder(float_model)  # quantise-at-load of the same float weights
    a, b = loaded.hf.model.layers[0].mlp.down_proj, float_model.model.layers[0].mlp.down_proj
    assert torch.equal(a.weight.view(torch.uint8), b.weight.view(torch.uint8))
    assert torch.equal(_logits(loaded), _logits(HFModel(float_model)))


def test_a_checkpoint_with_a_missing_scale_is_refused_naming_it(tmp_path):
    float_model = _float_model()
    path, tensors = _transformers_fp8_checkpoint(tmp_path, float_model)
    del tensors["model.layers.1.self_attn.o_proj.weight_scale_inv"]
    _write(tmp_path, float_model, tensors, FP8_CONFIG)
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.o_proj\.weight_scale_inv"):
        HFModel.from_pretrained(path, dtype=torch.float32)


def test_a_scale_of_the_wrong_shape_is_refused(tmp_path):
    float_model = _float_model()
    path, tensors = _transformers_fp8_checkpoint(tmp_path, float_model)
    tensors["model.layers.0.mlp.up_proj.weight_scale_inv"] = torch.ones(3, 3)
    _write(tmp_path, float_model, tensors, FP8_CONFIG)
    with pytest.raises(CheckpointError, match=r"up_proj\.weight_scale_inv"):
        HFModel.from_pretrained(path, dtype=torch.float32)


def test_an_unknown_quant_method_is_refused_naming_it():
    with pytest.raises(ConfigError, match="'gptq'"):
        read_scheme({"quant_method": "gptq", "bits": 4})


def test_compressed_tensors_schemes_other_than_fp8_are_refused():
    int8 = json.loads(json.dumps(CT_CONFIG))
    int8["config_groups"]["group_0"]["weights"]["type"] = "int"
    with pytest.raises(ConfigError):
        read_scheme(int8)
    assert read_scheme(CT_CONFIG).strategy == "channel" and read_scheme(FP8_CONFIG).block == (128, 128)


def test_from_pretrained_with_quantization_fp8_quantises_a_float_directory_at_load(tmp_path):
    float_model = _float_model()
    float_model.save_pretrained(tmp_path)
    loaded = HFModel.from_pretrained(tmp_path, dtype=torch.float32, quantization="fp8")
    assert isinstance(loaded.hf.model.layers[0].self_attn.o_proj, Fp8Linear)
    quantize_decoder(float_model)
    assert torch.equal(_logits(loaded), _logits(HFModel(float_model)))
    with pytest.raises(ConfigError):
        HFModel.from_pretrained(tmp_path, quantization="int8")
