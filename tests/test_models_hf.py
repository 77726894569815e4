"""transformers as the outside oracle: tiny Qwen3 and Llama served through HFModel + the cache."""

from __future__ import annotations

import math

import pytest
import torch

from tests.model_loop import greedy_through_cache, make_cache, run_step, text_idx

transformers = pytest.importorskip("transformers")

from batchkv.cache import LayerSpec  # noqa: E402
from batchkv.errors import ConfigError, ContractError  # noqa: E402
from batchkv.models.hf import HFModel, batchkv_attention  # noqa: E402

GEOMETRY = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
}


@torch.no_grad()
def _peaky(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Re-draw weights so greedy decoding has clear winners (the default init gives near-ties)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if p.dim() == 1:
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
        else:
            std = 8.0 / math.sqrt(p.shape[1]) if "lm_head" in name else 1.0 / math.sqrt(p.shape[1])
            p.copy_(torch.randn(p.shape, generator=gen) * (1.0 if "embed" in name else std))
    return model.eval()


def _qwen3(**extra):
    cfg = transformers.Qwen3Config(**GEOMETRY, attn_implementation="sdpa", **extra)
    return _peaky(transformers.Qwen3ForCausalLM(cfg), seed=0)


def _llama():
    cfg = transformers.LlamaConfig(**GEOMETRY, attn_implementation="eager")
    return _peaky(transformers.LlamaForCausalLM(cfg), seed=1)


def _sliding_qwen3():
    # layer 0 full, layers 1-2 windowed over 5 positions: prompts below run past the window
    return _qwen3(use_sliding_window=True, sliding_window=5, max_window_layers=1)


MODELS = {"qwen3": _qwen3, "llama": _llama, "qwen3-sliding": _sliding_qwen3}
PROMPTS = [[5, 17, 33], [101, 7, 7, 250, 3, 88, 41, 19, 2, 64, 77], [9, 200, 150, 4, 61, 12]]


def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    out = hf.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_greedy_tokens_through_the_cache_equal_the_models_own_generate(name):
    hf = MODELS[name]()
    max_new = [9, 6, 12]
    got = greedy_through_cache(HFModel(hf), PROMPTS, max_new, max_write=4, bucket=4)
    for prompt, n, tokens in zip(PROMPTS, max_new, got, strict=True):
        assert tokens == _hf_greedy(hf, prompt, n)
    assert hf.config._attn_implementation in ("sdpa", "eager")  # restored after every call


@pytest.mark.parametrize("name", sorted(MODELS))
def test_packed_chunked_prefill_logits_equal_the_models_full_forward(name):
    hf = MODELS[name]()
    model = HFModel(hf)
    cache = make_cache(model, max_seqs=3, max_write=8)
    seqs = [cache.seq_new() for _ in PROMPTS]
    got: list[list[torch.Tensor]] = [[], [], []]
    fed = [0, 0, 0]
    for step in ([(0, 2), (1, 5), (2, 3)], [(1, 6), (2, 3), (0, 1)]):
        chunks = []
        for s, n in step:
            chunks.append((seqs[s], PROMPTS[s][fed[s] : fed[s] + n], text_idx(fed[s], n)))
            fed[s] += n
        logits = run_step(model, cache, chunks, width=16)
        row = 0
        for s, n in step:
            got[s].append(logits[row : row + n])
            row += n
    for s, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            expected = hf(torch.tensor([prompt])).logits[0].float()
        torch.testing.assert_close(torch.cat(got[s]), expected, atol=2e-4, rtol=1e-4)


def test_cache_spec_follows_the_config_including_sliding_layers():
    spec = HFModel(_sliding_qwen3()).cache_spec()
    assert (spec["num_layers"], spec["kv_heads"], spec["head_dim"], spec["dtype"]) == (3, 2, 16, torch.float32)
    assert spec["layers"] == (LayerSpec(), LayerSpec("flat", window=5), LayerSpec("flat", window=5))
    assert HFModel(_llama()).cache_spec()["layers"] == (LayerSpec(),) * 3


def test_a_softcapping_config_whose_attention_does_not_pass_the_cap_on_is_refused():
    hf = _qwen3()
    hf.config.attn_logit_softcapping = 50.0  # Qwen3's attention never reads it: served as is it would be wrong
    with pytest.raises(ConfigError, match="attn_logit_softcapping"):
        HFModel(hf)


def test_attention_sinks_that_the_attention_does_not_hand_over_are_refused():
    hf = _qwen3()
    hf.model.layers[0].self_attn.sinks = torch.nn.Parameter(torch.zeros(4))  # Qwen3's forward never reads them
    with pytest.raises(ConfigError, match="sinks"):
        HFModel(hf)


class _Recording:
    """A cache that records what the attention function hands it and returns zeros."""

    def __init__(self):
        self.calls = []

    def update_and_attend(self, layer, q, k, v, **kwargs):
        self.calls.append((layer, kwargs))
        return torch.zeros_like(q)


def test_the_attention_hands_the_cache_a_soft_cap_and_sinks_only_when_the_model_has_them():
    hf = _qwen3()
    x, cache = torch.zeros(1, 4, 3, 16), _Recording()
    module = hf.model.layers[1].self_attn
    batchkv_attention(module, x, x, x, None, scaling=0.25, batchkv_cache=cache)
    batchkv_attention(module, x, x, x, None, scaling=0.25, batchkv_cache=cache, softcap=50, s_aux=torch.ones(4))
    (layer, plain), (_, extras) = cache.calls
    assert layer == 1 and plain == {"scale": 0.25}
    assert extras["softcap"] == 50.0 and torch.equal(extras["sinks"], torch.ones(4))


def test_the_attention_outside_an_hfmodel_call_raises_contract_error():
    hf = _qwen3()
    x = torch.zeros(1, 4, 3, 16)
    with pytest.raises(ContractError, match="HFModel"):
        batchkv_attention(hf.model.layers[0].self_attn, x, x, x, None)


@pytest.mark.parametrize("model_type", ["gemma2", "cohere", "granite", "llama"])
def test_head_of_the_hidden_states_gives_the_logits_of_the_models_own_forward(model_type):
    # speculative verification samples from head(hidden_states(...)): a final soft-cap (Gemma2) or a
    # logit scale (Cohere, Granite) that only the model's forward applied would change its distribution
    from tests.test_model_coverage import ARCHS, build

    arch = next(a for a in ARCHS if a.model_type == model_type)
    model = HFModel(build(arch))
    cache = make_cache(model, max_seqs=1, max_write=16)
    seq = cache.seq_new()
    ids, idx, rows = torch.tensor(PROMPTS[1]), text_idx(0, len(PROMPTS[1])), torch.arange(len(PROMPTS[1]))
    cache.declare_step([seq] * len(ids))
    cache.prepare_step(len(ids))
    h = model.hidden_states(ids, idx, cache, rows)
    with torch.no_grad():
        want = model.hf(ids[None]).logits[0]
    torch.testing.assert_close(model.head(h), want, atol=1e-4, rtol=1e-4)


def test_an_engine_without_a_capacity_takes_the_configs_max_position_embeddings():
    from batchkv.executor import Engine

    model = HFModel(_qwen3())
    assert model.max_positions == GEOMETRY["max_position_embeddings"]
    assert Engine(model, max_step_tokens=16, prefill_chunk=8).cache.capacity == 256
