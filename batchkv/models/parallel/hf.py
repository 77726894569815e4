"""What one tensor-parallel rank holds of a transformers Llama or Qwen3, and its modules swapped for it.

`spans` says which slice of each projection's weight a rank holds; `shard_modules` swaps a model
built on the meta device from its whole config (so its modules, config and RoPE are the model's
own) for this rank's (`batchkv.models.parallel.layers`): q/k/v and gate/up `nn.Linear`s with this
rank's output features, o and down `RowParallelLinear`s, the embedding and LM head vocab-parallel;
`span_of` names the slice of each parameter to read (`SafetensorsSlices`), so no rank reads or
holds the whole model. `batchkv.models.loading.load_hf_shard` puts them together. The attention
modules reshape with -1 heads, so they run on this rank's heads unchanged; `HFModel(shard=...)`
reports this rank's KV heads to its cache.
"""

from __future__ import annotations

from torch import nn

from batchkv.models.parallel.layers import ParallelLMHead, RowParallelLinear, VocabParallelEmbedding
from batchkv.models.parallel.shard import Shard


def _linear(module: nn.Linear, features: int, dim: int, shard: Shard) -> nn.Linear:
    """`module` with `features` of its outputs (dim 0: column-parallel) or inputs (dim 1: row-parallel)."""
    bias, kw = module.bias is not None, {"dtype": module.weight.dtype}
    if dim == 0:
        return nn.Linear(module.in_features, features, bias=bias, **kw)
    return RowParallelLinear(features, module.out_features, bias, shard, **kw)


def spans(config, shard: Shard) -> dict[str, tuple[int, range]]:
    """Projection name -> (dim, range) this rank holds of its weight (and of a column-parallel bias)."""
    heads = config.num_attention_heads
    d = getattr(config, "head_dim", None) or config.hidden_size // heads
    q, kv = (range(h.start * d, h.stop * d) for h in shard.heads(heads, config.num_key_value_heads or heads))
    inter = shard.part(config.intermediate_size, "intermediate_size")
    return {"q_proj": (0, q), "k_proj": (0, kv), "v_proj": (0, kv), "o_proj": (1, q), "gate_proj": (0, inter),
            "up_proj": (0, inter), "down_proj": (1, inter)}  # fmt: skip


def shard_modules(hf: nn.Module, config, shard: Shard, spans: dict[str, tuple[int, range]]) -> None:
    """Swap `hf`'s projections, embedding and LM head (on the meta device) for this rank's."""
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


def span_of(name: str, spans: dict[str, tuple[int, range]], shard: Shard, vocab: int) -> tuple[int, range] | None:
    """(dim, range) of parameter `name` this rank reads; None: it holds the whole tensor."""
    part, kind = name.rsplit(".", 2)[-2:]
    if part in ("embed_tokens", "lm_head"):
        return 0, shard.vocab(vocab)
    span = spans.get(part)
    if span is None or (kind == "bias" and span[0] == 1):  # norms; a row-parallel bias is held whole
        return None
    return 0 if kind == "bias" else span[0], span[1]
