"""What `batchkv serve --model` accepts: a SenseNova-U1 directory (config.json + shards with the
language model under a prefix and generation-branch tensors beside it), transformers families, and
a clear refusal of anything else."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("safetensors")

from safetensors.torch import save_file

from batchkv.errors import ConfigError
from batchkv.models import build_model
from batchkv.models.weights import checkpoint_tensors
from batchkv.serve.loading import load_served_model

TINY = {  # sensenova-u1-tiny's geometry under transformers' names
    "num_hidden_layers": 4, "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 32, "intermediate_size": 256, "vocab_size": 512, "torch_dtype": "float32",
}  # fmt: skip


def test_a_sensenova_directory_loads_its_prefixed_language_model_and_skips_the_generation_branch(tmp_path):
    source = build_model("sensenova-u1-tiny", "cpu", seed=3)
    tensors = {f"language_model.{k}": v for k, v in checkpoint_tensors(source).items()}
    tensors["language_model.model.layers.0.mlp.gate_proj_mot_gen.weight"] = torch.zeros(3, 3)
    tensors["language_model.model.embed_tokens_mot_gen.weight"] = torch.zeros(3, 3)
    save_file(tensors, str(tmp_path / "model-00002-of-00002.safetensors"))
    branch = {"gen_mot_gen.model.embed_tokens.weight": torch.zeros(3, 3)}  # in the shard read first
    save_file(branch, str(tmp_path / "model-00001-of-00002.safetensors"))
    config = {"model_type": "sensenova_u1", "architectures": ["SenseNovaU1ForConditionalGeneration"],
              "llm_config": {**TINY, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096}}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    served = load_served_model(str(tmp_path), "cpu")
    assert served.kind == "sensenova" and served.tokenizer is None and served.max_positions == 4096
    for (name, a), b in zip(checkpoint_tensors(served.model).items(), checkpoint_tensors(source).values(), strict=True):
        assert torch.equal(a, b), name


def test_a_transformers_family_outside_the_served_ones_is_refused_naming_it(tmp_path):
    config = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=r"gpt2.*GPT2LMHeadModel"):
        load_served_model(str(tmp_path), "cpu")


def test_neither_a_directory_nor_a_preset_is_refused_naming_the_presets(tmp_path):
    with pytest.raises(ConfigError, match="sensenova-u1-tiny"):
        load_served_model(str(tmp_path / "missing"), "cpu")
    with pytest.raises(ConfigError, match=r"config\.json"):
        load_served_model(str(tmp_path), "cpu")
