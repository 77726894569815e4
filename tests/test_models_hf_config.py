"""A transformers config whose layers transformers reads as full attention is served as full attention."""

from __future__ import annotations

import pytest
import torch

from tests.model_loop import greedy_through_cache

transformers = pytest.importorskip("transformers")

from batchkv.cache import LayerSpec  # noqa: E402
from batchkv.models.hf import HFModel  # noqa: E402

GEOMETRY = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}  # fmt: skip


def test_sliding_layer_types_without_a_window_are_full_attention_as_in_transformers():
    # layer_types say sliding while use_sliding_window=False leaves no window: transformers' Qwen3
    # attention then takes sliding_window None, no window. (Its 5.x mask builder refuses to run this
    # config, so the oracle is the same weights with the layers declared full.)
    sliding = transformers.Qwen3Config(**GEOMETRY, layer_types=["sliding_attention"] * 2, use_sliding_window=False)
    assert sliding.sliding_window is None
    torch.manual_seed(0)
    model = HFModel(transformers.Qwen3ForCausalLM(sliding).eval())
    assert model.cache_spec()["layers"] == (LayerSpec(), LayerSpec())
    oracle = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**GEOMETRY, attn_implementation="sdpa")).eval()
    oracle.load_state_dict(model.hf.state_dict())
    prompt = [5, 17, 33, 101, 7, 7, 250, 3, 88, 41, 19]
    with torch.no_grad():
        expected = oracle.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
                                   max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)  # fmt: skip
    assert greedy_through_cache(model, [prompt], [6], max_write=4, bucket=4)[0] == expected[0, len(prompt) :].tolist()
