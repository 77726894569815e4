"""One rank's share of a model: which heads, MLP columns and vocabulary rows it holds, and the
collectives that join the shares (Megatron-style tensor parallelism).

    q, k, v, gate, up    column-parallel: rank r holds a contiguous 1/N of the output features
    o, down              row-parallel: rank r holds the matching 1/N of the input features; the
                         partial products are summed with one all-reduce (`all_reduce`)
    embedding            vocab-parallel: rank r holds rows [r * V', (r + 1) * V'), V' = ceil(V / N);
                         ids outside its rows give zeros, then one all-reduce (`embed`)
    LM head              vocab-parallel: rank r computes its V' logits of each row; one all-gather
                         gives every rank the whole [R, V] (`gather`), padding columns dropped

KV heads: with Hkv >= N each rank holds Hkv / N of them; with Hkv < N (N a multiple of Hkv) each
KV head is replicated on N / Hkv ranks and a rank holds one, the one its query heads read (as
vLLM does). A one-rank `Shard()` is the whole model: every range is everything, `all_reduce` and
`gather` return their input, `embed` is `F.embedding`, so a model written against a `Shard` runs
unchanged without torch.distributed.

Collectives are capturable on NCCL (fixed shapes, no host reads); on gloo (CPU) they run eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from batchkv.errors import ConfigError


def _gather_single(out: torch.Tensor, part: torch.Tensor, group: object) -> None:
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch 2.6 lacks the former
    gather(out, part, group=group)


@dataclass(frozen=True)
class Shard:
    """Rank `rank` of `world`, on `device`; `group` is the process group of the model's collectives
    (None: the default group). Built once per process, never pickled."""

    rank: int = 0
    world: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    group: object | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world:
            raise ConfigError(f"tensor-parallel rank {self.rank} is outside [0, {self.world})")
        object.__setattr__(self, "device", torch.device(self.device))

    # ---- partitions -------------------------------------------------------------------------
    def part(self, n: int, what: str) -> range:
        """This rank's contiguous 1/world of `n` (n must divide evenly)."""
        if n % self.world:
            raise ConfigError(f"{what} is {n}, which {self.world} tensor-parallel ranks cannot split evenly")
        size = n // self.world
        return range(self.rank * size, (self.rank + 1) * size)

    def heads(self, q_heads: int, kv_heads: int) -> tuple[range, range]:
        """This rank's query heads and KV heads (one replicated KV head when kv_heads < world)."""
        q = self.part(q_heads, "the number of query heads")
        if kv_heads >= self.world:
            return q, self.part(kv_heads, "the number of KV heads")
        if self.world % kv_heads:
            raise ConfigError(
                f"{kv_heads} KV heads over {self.world} tensor-parallel ranks: with fewer KV heads than ranks, the "
                "ranks must be a multiple of the KV heads (each KV head is then replicated)"
            )
        head = self.rank // (self.world // kv_heads)
        return q, range(head, head + 1)

    def vocab_rows(self, vocab: int) -> int:
        """Rows of the embedding and LM head one rank holds: ceil(vocab / world)."""
        return -(-vocab // self.world)

    def vocab(self, vocab: int) -> range:
        """The token ids whose rows this rank holds (the last ranks hold fewer when vocab does not divide)."""
        rows = self.vocab_rows(vocab)
        return range(min(vocab, self.rank * rows), min(vocab, (self.rank + 1) * rows))

    # ---- collectives (capturable on NCCL) ----------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of every rank's `x` (in place); `x` itself on one rank. The row-parallel join."""
        if self.world > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def embed(self, ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """Embeddings [..., H] of int64 ids [...] from this rank's rows `table` [V', H] (vocab-parallel)."""
        if self.world == 1:
            return F.embedding(ids, table)
        rows = table.shape[0]
        local = ids - self.rank * rows
        outside = (local < 0) | (local >= rows)
        out = F.embedding(local.clamp(0, rows - 1), table).masked_fill(outside.unsqueeze(-1), 0)
        return self.all_reduce(out)

    def gather(self, logits: torch.Tensor, vocab: int) -> torch.Tensor:
        """Whole-vocabulary logits [R, vocab] from every rank's [R, V'] share (an all-gather)."""
        if self.world == 1:
            return logits
        r, rows = logits.shape
        out = torch.empty(self.world * r, rows, dtype=logits.dtype, device=logits.device)
        _gather_single(out, logits.contiguous(), self.group)
        return out.view(self.world, r, rows).transpose(0, 1).reshape(r, self.world * rows)[:, :vocab]
