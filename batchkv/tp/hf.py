"""One tensor-parallel rank's share of a transformers Llama or Qwen3, loaded slice by slice.

The model is built on the meta device from its whole config (so its modules, config and RoPE are
the model's own), its projections are swapped for this rank's (`batchkv.tp.layers`): q/k/v and
gate/up `nn.Linear`s with this rank's output features, o and down `RowParallelLinear`s, the
embedding and LM head vocab-parallel. Then it is materialised on the rank's device and every
parameter is read from the safetensors files as the slice this rank holds (`SafetensorsSlices`),
so no rank reads or holds the whole model. The attention modules reshape with -1 heads, so they
run on this rank's heads unchanged; `HFModel(shard=...)` reports this rank's KV heads to its cache.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from batchkv.errors import CheckpointError, ConfigError
from batchkv.tp.layers import ParallelLMHead, RowParallelLinear, VocabParallelEmbedding
from batchkv.tp.shard import Shard
from batchkv.tp.slices import SafetensorsSlices

FAMILIES = ("llama", "qwen3")


def _linear(module: nn.Linear, features: int, dim: int, shard: Shard) -> nn.Linear:
    """`module` with `features` of its outputs (dim 0: column-parallel) or inputs (dim 1: row-parallel)."""
    bias, kw = module.bias is not None, {"dtype": module.weight.dtype}
    if dim == 0:
        return nn.Linear(module.in_features, features, bias=bias, **kw)
    return RowParallelLinear(features, module.out_features, bias, shard, **kw)


def _spans(config, shard: Shard) -> dict[str, tuple[int, range]]:
    """Projection name -> (dim, range) this rank holds of its weight (and of a column-parallel bias)."""
    heads = config.num_attention_heads
    d = getattr(config, "head_dim", None) or config.hidden_size // heads
    q, kv = (range(h.start * d, h.stop * d) for h in shard.heads(heads, config.num_key_value_heads or heads))
    inter = shard.part(config.intermediate_size, "intermediate_size")
    return {"q_proj": (0, q), "k_proj": (0, kv), "v_proj": (0, kv), "o_proj": (1, q), "gate_proj": (0, inter),
            "up_proj": (0, inter), "down_proj": (1, inter)}  # fmt: skip


def _shard_modules(hf: nn.Module, config, shard: Shard, spans: dict[str, tuple[int, range]]) -> None:
    decoder = getattr(hf, hf.base_model_prefix)
    for layer in decoder.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, (dim, span) in spans.items():
                if isinstance(getattr(parent, name, None), nn.Linear):
                    setattr(parent, name, _linear(getattr(parent, name), len(span), dim, shard))
    dtype = decoder.embed_tokens.weight.dtype
    decoder.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, shard, dtype=dtype)
    hf.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, shard, dtype=dtype)
    if getattr(config, "tie_word_embeddings", False):
        hf.lm_head.weight = decoder.embed_tokens.weight


def _span_of(name: str, spans: dict[str, tuple[int, range]], shard: Shard, vocab: int) -> tuple[int, range] | None:
    part, kind = name.rsplit(".", 2)[-2:]
    if part in ("embed_tokens", "lm_head"):
        return 0, shard.vocab(vocab)
    span = spans.get(part)
    if span is None or (kind == "bias" and span[0] == 1):  # norms; a row-parallel bias is held whole
        return None
    return 0 if kind == "bias" else span[0], span[1]


def load_hf_shard(
    path: str | os.PathLike, shard: Shard, *, dtype: torch.dtype | None = None, kv_dtype: torch.dtype | None = None,
    quantization: str | None = None,
):  # fmt: skip
    """`HFModel` of rank `shard.rank`'s share of the transformers model directory `path`;
    `quantization="fp8"`: its projections `Fp8Linear`s (a row-parallel one keeps its all-reduce)."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from batchkv.models.hf import HFModel

    path = Path(path)
    config = AutoConfig.from_pretrained(str(path))
    if getattr(config, "quantization_config", None) is not None:
        raise ConfigError(f"{path}: an FP8 checkpoint is served on one GPU; tensor parallelism reads float "
                          "checkpoints (give one and quantization='fp8')")  # fmt: skip
    if config.model_type not in FAMILIES:
        raise ConfigError(f"{path}: tensor parallelism shards the transformers families {FAMILIES}, not "
                          f"{config.model_type!r}")  # fmt: skip
    spans = _spans(config, shard)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config, dtype=dtype or config.dtype)
        _shard_modules(hf, config, shard, spans)
    hf.to_empty(device=shard.device)
    decoder = getattr(hf, hf.base_model_prefix)
    tied = getattr(config, "tie_word_embeddings", False)
    if tied:  # to_empty gives each module a tensor of its own: tie them again (one copy of the rows)
        hf.lm_head.weight = decoder.embed_tokens.weight
    decoder.rotary_emb = type(decoder.rotary_emb)(config).to(shard.device)  # its tables, which meta left empty
    with SafetensorsSlices(path) as ckpt, torch.no_grad():
        for name, param in hf.named_parameters():
            source = "model.embed_tokens.weight" if tied and name == "lm_head.weight" else name
            if source not in ckpt:
                raise CheckpointError(f"{path} has no tensor {source} (a {config.model_type} of this config needs it)")
            span = _span_of(name, spans, shard, config.vocab_size)
            part = ckpt.read(source, *(span or (None, None)))
            param[: part.shape[0]].copy_(part)
            param[part.shape[0] :].zero_()  # the last ranks' vocabulary padding
    if (path / "generation_config.json").is_file():
        hf.generation_config = GenerationConfig.from_pretrained(str(path))
    if quantization is not None:
        from batchkv.models.hf import quantize_decoder

        quantize_decoder(hf)
    model = HFModel(hf.eval(), kv_dtype=kv_dtype, shard=shard)
    model.directory = path
    return model
