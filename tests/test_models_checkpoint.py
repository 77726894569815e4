"""SenseNova-U1 safetensors checkpoints: names, fusion on load, round trip, typed refusals."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from batchkv.errors import CheckpointError
from batchkv.models import build_model, checkpoint_shapes, load_checkpoint, save_checkpoint
from batchkv.models.weights import checkpoint_tensors

TINY = "sensenova-u1-tiny"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model = build_model(TINY, seed=11)
    path = tmp_path_factory.mktemp("ckpt") / "tiny.safetensors"
    save_checkpoint(model, path)
    return model, path


def _tensors(path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


def _params(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_a_saved_checkpoint_has_the_documented_separate_names_and_shapes(saved):
    model, path = saved
    tensors = _tensors(path)
    cfg = model.config
    assert {k: tuple(v.shape) for k, v in tensors.items()} == checkpoint_shapes(cfg)
    d = cfg.head_dim
    assert tensors["model.layers.0.self_attn.q_proj.weight"].shape == (cfg.q_heads * d, cfg.hidden)
    assert tensors["model.layers.3.self_attn.k_norm_hw.weight"].shape == (d // 2,)
    assert tensors["model.layers.2.mlp.up_proj.weight"].shape == (cfg.intermediate, cfg.hidden)


def test_a_checkpoint_round_trip_restores_every_weight_and_the_logits(saved):
    model, path = saved
    loaded = build_model(TINY, checkpoint=path)
    for a, b in zip(model.parameters(), loaded.parameters(), strict=True):
        assert torch.equal(a, b)
    other = build_model(TINY, seed=12)
    assert not torch.equal(other.lm_head, model.lm_head)


def test_loading_fuses_q_k_v_gate_up_and_the_norm_halves_in_checkpoint_order(tmp_path):
    cfg = build_model(TINY).config
    gen = torch.Generator().manual_seed(0)
    tensors = {k: torch.randn(shape, generator=gen) for k, shape in checkpoint_shapes(cfg).items()}
    path = tmp_path / "hand.safetensors"
    save_file(tensors, str(path))
    model = build_model(TINY, checkpoint=path)
    layer, p = model.layers[1], "model.layers.1."
    q, k, v = (tensors[p + f"self_attn.{n}_proj.weight"] for n in "qkv")
    assert torch.equal(layer.qkv, torch.cat([q, k, v]))
    gate, up = tensors[p + "mlp.gate_proj.weight"], tensors[p + "mlp.up_proj.weight"]
    assert torch.equal(layer.gate_up, torch.cat([gate, up]))
    assert torch.equal(layer.q_norm[0], tensors[p + "self_attn.q_norm.weight"])  # t half
    assert torch.equal(layer.q_norm[1], tensors[p + "self_attn.q_norm_hw.weight"])  # h|w half
    assert torch.equal(layer.k_norm[1], tensors[p + "self_attn.k_norm_hw.weight"])


def _write(tmp_path, tensors, name="bad.safetensors"):
    path = tmp_path / name
    save_file(tensors, str(path))
    return path


def test_a_missing_tensor_is_refused_by_name_and_the_model_is_unchanged(saved, tmp_path):
    _, path = saved
    tensors = _tensors(path)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    target = build_model(TINY, seed=99)
    before = _params(target)
    with pytest.raises(CheckpointError, match=r"missing \(1\): model\.layers\.1\.mlp\.up_proj\.weight"):
        load_checkpoint(target, _write(tmp_path, tensors))
    for a, b in zip(before, target.parameters(), strict=True):
        assert torch.equal(a, b)


def test_an_unexpected_tensor_is_refused_by_name(saved, tmp_path):
    _, path = saved
    tensors = _tensors(path)
    tensors["model.layers.9.self_attn.q_proj.weight"] = torch.zeros(2, 2)
    with pytest.raises(CheckpointError, match=r"unexpected \(1\): model\.layers\.9\.self_attn\.q_proj\.weight"):
        build_model(TINY, checkpoint=_write(tmp_path, tensors))


def test_a_misshapen_tensor_is_refused_with_both_shapes(saved, tmp_path):
    _, path = saved
    tensors = _tensors(path)
    tensors["lm_head.weight"] = torch.zeros(511, 128)
    with pytest.raises(CheckpointError, match=r"misshapen \(1\): lm_head\.weight \(511, 128\) != \(512, 128\)"):
        build_model(TINY, checkpoint=_write(tmp_path, tensors))


def test_a_nested_sharded_checkpoint_loads_with_prefix_and_skip(saved, tmp_path):
    model, path = saved
    tensors = {"language_model." + k: v for k, v in _tensors(path).items()}
    tensors["language_model.model.layers.0.self_attn.q_proj_mot_gen.weight"] = torch.zeros(3)
    tensors["vision_model.patch.weight"] = torch.zeros(3)
    names = sorted(tensors)
    folder = tmp_path / "shards"
    folder.mkdir()
    _write(folder, {k: tensors[k] for k in names[::2]}, "model-00001-of-00002.safetensors")
    _write(folder, {k: tensors[k] for k in names[1::2]}, "model-00002-of-00002.safetensors")
    with pytest.raises(CheckpointError, match="q_proj_mot_gen"):
        build_model(TINY, checkpoint=folder, prefix="language_model.")
    loaded = build_model(TINY, checkpoint=folder, prefix="language_model.", skip=("_mot_gen",))
    for a, b in zip(model.parameters(), loaded.parameters(), strict=True):
        assert torch.equal(a, b)


def test_weights_are_cast_to_the_requested_dtype_on_load(saved):
    model, path = saved
    half = build_model(TINY, dtype=torch.bfloat16, checkpoint=path)
    assert half.dtype == torch.bfloat16
    assert torch.equal(half.layers[0].qkv, model.layers[0].qkv.to(torch.bfloat16))
    assert checkpoint_tensors(half)["lm_head.weight"].dtype == torch.bfloat16


def test_a_path_without_a_checkpoint_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="no safetensors checkpoint"):
        build_model(TINY, checkpoint=tmp_path)
