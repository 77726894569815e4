"""Tensor-parallel layers for transformers models (`batchkv.models.parallel.hf` puts them in place).

Column-parallel projections need no class of their own: an `nn.Linear` with this rank's output
features is one. The others:
- `RowParallelLinear`: this rank's input features; the partial products are summed over ranks
  with one all-reduce, then the bias (held whole by every rank) is added once.
- `VocabParallelEmbedding`: this rank's rows of the table (`Shard.embed`: zeros for ids held
  elsewhere, then one all-reduce).
- `ParallelLMHead`: this rank's rows of the head; its logits are gathered into the whole
  vocabulary (`Shard.gather`), so the caller sees [..., vocab] as from an `nn.Linear`.
All capturable on NCCL.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from batchkv.models.parallel.shard import Shard


class RowParallelLinear(nn.Linear):
    """y = sum over ranks of x_r @ W_r.T, plus the bias: x [..., in_features / N] -> [..., out_features]."""

    def __init__(self, in_features: int, out_features: int, bias: bool, shard: Shard, **kwargs) -> None:
        super().__init__(in_features, out_features, bias=bias, **kwargs)
        self.shard = shard

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.shard.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """The rows [r V', (r + 1) V') of a [vocab, hidden] table: ids [...] -> [..., hidden]."""

    def __init__(self, vocab: int, hidden: int, shard: Shard, **kwargs) -> None:
        super().__init__()
        self.shard, self.num_embeddings, self.embedding_dim = shard, vocab, hidden
        self.weight = nn.Parameter(torch.empty(shard.vocab_rows(vocab), hidden, **kwargs), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.shard.embed(ids, self.weight)


class ParallelLMHead(nn.Module):
    """The rows [r V', (r + 1) V') of a [vocab, hidden] LM head: h [..., hidden] -> logits [..., vocab]."""

    def __init__(self, vocab: int, hidden: int, shard: Shard, **kwargs) -> None:
        super().__init__()
        self.shard, self.vocab_size, self.in_features = shard, vocab, hidden
        self.weight = nn.Parameter(torch.empty(shard.vocab_rows(vocab), hidden, **kwargs), requires_grad=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        logits = F.linear(h, self.weight)
        whole = self.shard.gather(logits.reshape(-1, logits.shape[-1]), self.vocab_size)
        return whole.reshape(*h.shape[:-1], self.vocab_size)
