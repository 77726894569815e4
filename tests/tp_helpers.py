"""Model factories for the tensor-parallel tests. Each rank's process builds its share by calling
one of these with its `Shard`, so they live at module level (spawn pickles them by name)."""

from __future__ import annotations

import math
import time
from dataclasses import replace

import torch

from batchkv.models import build_model, preset_config
from batchkv.models.parallel import Shard

TINY = preset_config("sensenova-u1-tiny")  # 4 query heads, 2 KV heads, MLP 256, vocab 512
ONE_KV_HEAD = replace(TINY, kv_heads=1)  # at 2 ranks its KV head is replicated


def one_kv_head(shard: Shard):
    """SenseNova tiny with one KV head: two ranks each hold a copy of it."""
    return build_model(ONE_KV_HEAD, shard.device, seed=0, shard=shard)


class Faulty:
    """A model whose forward fails on rank `rank` from its call `after + 1` on: it raises, or
    (hang=True) never returns. Everything else is the wrapped model's."""

    def __init__(self, model, rank: int, after: int, hang: bool) -> None:
        self.model, self.fail_rank, self.after, self.hang, self.calls = model, rank, after, hang, 0
        self.vocab_size, self.device = model.vocab_size, model.device

    def cache_spec(self) -> dict:
        return self.model.cache_spec()

    def __call__(self, input_ids, indexes, cache, logits_rows):
        self.calls += 1
        if self.model.shard.rank == self.fail_rank and self.calls > self.after:
            if self.hang:
                time.sleep(3600)
            raise RuntimeError("an injected fault in the forward")
        return self.model(input_ids, indexes, cache, logits_rows)


def faulty(shard: Shard, *, rank: int = 1, after: int = 3, hang: bool = False) -> Faulty:
    return Faulty(build_model("sensenova-u1-tiny", shard.device, seed=0, shard=shard), rank, after, hang)


def save_hf(path, family: str = "qwen3", **geometry) -> torch.nn.Module:
    """A tiny transformers Qwen3 or Llama (`family`) with clear greedy winners (the default init
    gives near-ties), saved to `path` in transformers' format; returns the whole model (the
    one-process oracle). `geometry` overrides the config's fields."""
    import transformers

    kind = {"qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
            "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM)}[family]  # fmt: skip
    cfg = kind[0](
        **{"vocab_size": 250, "hidden_size": 96, "intermediate_size": 192, "num_hidden_layers": 3,
           "num_attention_heads": 12, "num_key_value_heads": 6, "head_dim": 16, "max_position_embeddings": 256,
           "tie_word_embeddings": False, **geometry}
    )  # fmt: skip
    model = kind[1](cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_((1.0 if "norm" in name else 0.0) + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                std = (8.0 if "lm_head" in name else 1.0) / math.sqrt(p.shape[1])
                p.copy_(torch.randn(p.shape, generator=gen) * (1.0 if "embed" in name else std))
    model.save_pretrained(path)
    return model.eval()


def save_qwen3(path, **geometry) -> torch.nn.Module:
    """`save_hf(path, "qwen3", ...)`."""
    return save_hf(path, "qwen3", **geometry)


def hf_greedy(hf: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """transformers' own greedy `generate`: `n` new tokens of `prompt` (EOS suppressed)."""
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                      pad_token_id=0)  # fmt: skip
    return out[0, len(prompt) :].tolist()


def hf_last_logits(hf: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    """transformers' float32 logits [vocab] of the last position of `prompt` (its own attention)."""
    with torch.no_grad():
        return hf(torch.tensor([prompt])).logits[0, -1].float()
