"""The DFlash drafter on the column store against an eager dense-attention reference written here,
across several steps with rewinds; its checkpoint round trip by name; the targets' hidden-state
taps against transformers' own hidden states."""

from __future__ import annotations

import json
import random

import pytest
import torch
import torch.nn.functional as F

from batchkv.cache import BatchedSequenceCache, CacheConfig
from batchkv.errors import CheckpointError, ConfigError
from batchkv.models import build_model
from batchkv.models.dflash import (
    DFlashDrafter,
    build_drafter,
    checkpoint_names,
    load_drafter_weights,
    save_drafter,
)
from tests.model_loop import make_cache, text_idx


@pytest.fixture(scope="module")
def target():
    return build_model("sensenova-u1-tiny", "cpu", seed=0)


def _norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope_complex(x: torch.Tensor, t: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE as complex rotation of the pairs (x_j, x_{j + D/2}): x [L, H, D], t [L]."""
    d = x.shape[-1]
    freq = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    z = torch.complex(x[..., : d // 2].double(), x[..., d // 2 :].double())
    z = z * torch.polar(torch.ones_like(freq), t.double()[:, None] * freq)[:, None, :]
    return torch.cat([z.real, z.imag], dim=-1).to(x.dtype)


def reference_block(drafter: DFlashDrafter, feats, t_ctx, block_ids, t_block) -> torch.Tensor:
    """The DFlash forward of one block, dense: queries are the block; keys/values are the context
    features' projections at every position, then the block's own rows; no mask."""
    c, w = drafter.config, dict(drafter.state_dict())
    eps, hq, hkv, d = c.rms_eps, c.q_heads, c.kv_heads, c.head_dim
    ctx = _norm(feats @ w["fc.weight"].T, w["hidden_norm"], eps)
    h = drafter.target.embed(block_ids)
    t_all = torch.cat([t_ctx, t_block])
    for i in range(c.num_layers):
        p = {k[len(f"layers.{i}.") :]: v for k, v in w.items() if k.startswith(f"layers.{i}.")}
        x = _norm(h, p["input_layernorm.weight"], eps)
        q = _norm((x @ p["self_attn.q_proj.weight"].T).view(-1, hq, d), p["self_attn.q_norm.weight"], eps)
        kv_in = torch.cat([ctx, x])
        k = _norm((kv_in @ p["self_attn.k_proj.weight"].T).view(-1, hkv, d), p["self_attn.k_norm.weight"], eps)
        v = (kv_in @ p["self_attn.v_proj.weight"].T).view(-1, hkv, d)
        q, k = _rope_complex(q, t_block, c.rope_theta), _rope_complex(k, t_all, c.rope_theta)
        k, v = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
        a = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
        h = h + a.transpose(0, 1).reshape(len(block_ids), -1) @ p["self_attn.o_proj.weight"].T
        x = _norm(h, p["post_attention_layernorm.weight"], eps)
        gate, up = x @ p["mlp.gate_proj.weight"].T, x @ p["mlp.up_proj.weight"].T
        h = h + (F.silu(gate) * up) @ p["mlp.down_proj.weight"].T
    return _norm(h, w["norm"], eps)


@pytest.mark.parametrize("context_only", [False, True], ids=["every-step-drafts", "context-only-steps-between"])
def test_drafter_on_the_column_store_matches_the_dense_reference_across_steps_and_rewinds(target, context_only):
    """With context_only, every other step writes context rows alone (`write_context`, as when no
    sample drafts), and the blocks drafted after them still see every context position."""
    drafter = build_drafter(target, num_layers=2, target_layer_ids=(0, 2), block_size=5, seed=3)
    c = drafter.config
    cache = BatchedSequenceCache(CacheConfig(**drafter.cache_spec(), max_seqs=3, capacity=64, max_write=12,
                                             max_width=32), "cpu", attention="reference")  # fmt: skip
    for layer in range(c.num_layers):  # never-written storage is NaN: reading it would show
        cache.k_store(layer).fill_(float("nan"))
        cache.v_store(layer).fill_(float("nan"))
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(1)
    seqs = [cache.seq_new(), cache.seq_new()]
    offsets = {seqs[0]: 0, seqs[1]: 7}  # RoPE t = offset + position
    history = {s: torch.zeros(0, c.features) for s in seqs}
    checked = 0
    for step in range(7 if context_only else 4):
        write_only = context_only and step % 2 == 0
        ids, feats, is_ctx, t_index, rows, owners = [], [], [], [], [], []
        for s in seqs:
            new = rng.randint(1, 6)  # context rows committed since the last draft
            block = 0 if write_only else rng.randint(2, c.block_size)
            start = cache.pos(s)
            fresh = torch.randn(new, c.features, generator=gen)
            history[s] = torch.cat([history[s], fresh])
            anchor = rng.randrange(c.vocab)
            first = len(ids)
            ids += [0] * new + ([anchor] + [c.mask_token_id] * (block - 1) if block else [])
            feats += [*fresh, *torch.zeros(block, c.features)]
            is_ctx += [True] * new + [False] * block
            t_index += [offsets[s] + p for p in range(start, start + new + block)]
            rows += list(range(first + new, first + new + block))
            owners.append((s, new, block, anchor))
        width = len(ids) + 3  # padding rows too
        cache.declare_step([s for s, new, block, _ in owners for _ in range(new + block)])
        cache.prepare_step(width)
        pad = width - len(ids)
        features, t = torch.stack(feats + [torch.zeros(c.features)] * pad), torch.tensor(t_index + [0] * pad)
        if write_only:
            drafter.write_context(features, t, cache)
            cache.commit_step()
            continue
        out = drafter(torch.tensor(ids + [0] * pad), features, torch.tensor(is_ctx + [False] * pad), t, cache,
                      torch.tensor(rows))  # fmt: skip
        cache.commit_step()
        r = 0
        for s, _new, block, anchor in owners:
            cache.rewind(s, cache.pos(s) - block)  # only context K/V stay
            length = cache.pos(s)
            t_ctx = torch.arange(length) + offsets[s]
            block_ids = torch.tensor([anchor] + [c.mask_token_id] * (block - 1))
            expected = reference_block(drafter, history[s], t_ctx, block_ids, torch.arange(block) + length + offsets[s])
            torch.testing.assert_close(out[r : r + block], expected, atol=2e-4, rtol=2e-4)
            drafts = target.head(out[r + 1 : r + block]).argmax(-1)
            assert torch.equal(drafts, target.head(expected[1:]).argmax(-1))
            r += block
            checked += 1
    assert checked == (6 if context_only else 8)


def test_checkpoint_round_trip_by_the_published_names(target, tmp_path):
    drafter = build_drafter(target, num_layers=2, target_layer_ids=(1, 3), block_size=8, mask_token_id=5, seed=9)
    save_drafter(drafter, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["dflash_config"] == {"target_layer_ids": [1, 3], "block_size": 8, "mask_token_id": 5}
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    assert names == set(checkpoint_names(drafter.config))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.k_norm.weight",
            "layers.0.post_attention_layernorm.weight", "layers.1.mlp.down_proj.weight"} <= names  # fmt: skip
    loaded = build_drafter(target, checkpoint=tmp_path)
    assert loaded.config == drafter.config
    for (name, a), (_, b) in zip(drafter.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="up_proj"):
        build_drafter(target, checkpoint=tmp_path)


def test_an_unreadable_or_ill_typed_drafter_checkpoint_is_a_typed_refusal(target, tmp_path):
    drafter = build_drafter(target, num_layers=1, target_layer_ids=(1, 3), block_size=4, seed=9)
    save_drafter(drafter, tmp_path)
    before = {name: t.clone() for name, t in drafter.state_dict().items()}
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])  # a download cut short
    with pytest.raises(CheckpointError, match=r"model\.safetensors is not a readable"):
        load_drafter_weights(drafter, tmp_path)
    assert all(torch.equal(t, before[name]) for name, t in drafter.state_dict().items())
    config = json.loads((tmp_path / "config.json").read_text())
    for bad in (["1", "x"], [1.5, 3]):  # a layer id is an integer, never parsed or truncated into one
        config["dflash_config"]["target_layer_ids"] = bad
        (tmp_path / "config.json").write_text(json.dumps(config))
        with pytest.raises(ConfigError, match="target_layer_ids"):
            build_drafter(target, checkpoint=tmp_path)


def test_build_drafter_refuses_layers_the_target_does_not_have(target):
    with pytest.raises(ConfigError, match="target_layer_ids"):
        build_drafter(target, num_layers=1, target_layer_ids=(0, 4))


def test_sensenova_taps_hold_each_layers_output_for_the_tapped_rows(target):
    """Tapping layer l of the model equals the last layer's tap of the same model cut after
    layer l, whose output is that tap normed: so every tap is the residual stream after its layer."""
    from batchkv.models.sensenova import SenseNovaLM
    from batchkv.models.taps import HiddenTaps

    prompt = [5, 17, 33, 250, 7, 7, 91]
    full = HiddenTaps((0, 1, 2, 3), 128, 8, "cpu", torch.float32)
    cache = make_cache(target, max_seqs=1, max_write=8)
    s = cache.seq_new()
    cache.declare_step([s] * len(prompt))
    cache.prepare_step(8)
    ids = torch.tensor([*prompt, 0])
    target.hidden_states(ids, text_idx(0, 8), cache, torch.arange(7), taps=full.bind(8))
    for layer in range(4):
        cut = SenseNovaLM(type(target.config)(**{**vars(target.config), "num_layers": layer + 1}))
        cut.load_state_dict({k: v for k, v in target.state_dict().items() if not k.startswith("layers.")
                             or int(k.split(".")[1]) <= layer}, strict=False)  # fmt: skip
        last = HiddenTaps((layer,), 128, 8, "cpu", torch.float32)
        cut_cache = make_cache(cut, max_seqs=1, max_write=8)
        c = cut_cache.seq_new()
        cut_cache.declare_step([c] * len(prompt))
        cut_cache.prepare_step(8)
        out = cut.hidden_states(ids, text_idx(0, 8), cut_cache, torch.arange(7), taps=last.bind(8))
        torch.testing.assert_close(full.out[:7, layer * 128 : (layer + 1) * 128], last.out[:7])
        norm = F.rms_norm(last.out[:7], (128,), eps=target.config.rms_eps) * cut.norm
        torch.testing.assert_close(out, norm)


def test_transformers_taps_equal_the_models_own_hidden_states():
    pytest.importorskip("transformers")
    from batchkv.models.hf import HFModel
    from batchkv.models.taps import HiddenTaps
    from tests.test_executor_models import _qwen3

    hf = _qwen3()
    model = HFModel(hf)
    prompt = [5, 17, 33, 250, 7, 7, 91, 3, 3]
    # transformers' last hidden state is after the final norm; every other one is a layer's output
    taps = HiddenTaps((1, 0), 64, 16, "cpu", torch.float32)
    taps.rows.copy_(torch.tensor([8, 2, 0, 5] + [0] * 12))  # any rows, in any order
    cache = make_cache(model, max_seqs=1, max_write=16)
    s = cache.seq_new()
    cache.declare_step([s] * len(prompt))
    cache.prepare_step(12)
    ids = torch.tensor(prompt + [0] * 3)
    model.hidden_states(ids, text_idx(0, 12), cache, torch.tensor([8]), taps=taps.bind(4))
    with torch.no_grad():
        states = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    for j, layer in enumerate((1, 0)):
        expected = states[layer + 1][0, [8, 2, 0, 5]]
        torch.testing.assert_close(taps.out[:4, j * 64 : (j + 1) * 64], expected, atol=2e-5, rtol=1e-4)
