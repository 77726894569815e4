"""A small hand-written serving loop over BatchedSequenceCache, shared by the model tests.

It packs every live request into each step (a prefill chunk of at most `max_write` tokens, or one
decode token), pads the width up to a multiple of `bucket`, asks logits only for rows that
sample, and decodes greedily. Text tokens take RoPE index (t, 0, 0) with t = position.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from batchkv.cache import BatchedSequenceCache, CacheConfig


def make_cache(
    model, *, max_seqs: int, capacity: int = 128, max_write: int = 8, attention: str = "reference"
) -> BatchedSequenceCache:
    cfg = CacheConfig(**model.cache_spec(), max_seqs=max_seqs, capacity=capacity, max_write=max_write)
    return BatchedSequenceCache(cfg, model.device, attention=attention)


def run_step(
    model,
    cache,
    chunks: Sequence[tuple[int, Sequence[int], torch.Tensor]],
    width: int,
    rows: Sequence[int] | None = None,
) -> torch.Tensor:
    """One forward. chunks: (seq id, token ids, indexes [3, n]) in packed order.

    Returns float32 [R, vocab]: the logits of `rows` (default every real row), in that order.
    """
    seq_ids, ids, idx = [], [], []
    for seq, tokens, indexes in chunks:
        seq_ids += [seq] * len(tokens)
        ids += list(tokens)
        idx.append(indexes)
    n = len(ids)
    input_ids = torch.zeros(width, dtype=torch.int64)
    input_ids[:n] = torch.tensor(ids)
    indexes = torch.zeros(3, width, dtype=torch.int64)
    indexes[:, :n] = torch.cat(idx, dim=1)
    cache.declare_step(seq_ids)
    cache.prepare_step(width)
    dev = model.device
    rows_t = torch.arange(n) if rows is None else torch.tensor(list(rows), dtype=torch.int64)
    logits = model(input_ids.to(dev), indexes.to(dev), cache, rows_t.to(dev))
    cache.commit_step()
    return logits.cpu()


def text_idx(start: int, n: int) -> torch.Tensor:
    idx = torch.zeros(3, n, dtype=torch.int64)
    idx[0] = torch.arange(start, start + n)
    return idx


def greedy_through_cache(
    model,
    prompts: Sequence[Sequence[int]],
    max_new: Sequence[int],
    *,
    max_write: int = 8,
    bucket: int = 8,
    stop_ids: Sequence[int] = (),
    capacity: int = 128,
    attention: str = "reference",
) -> list[list[int]]:
    """Greedy continuations of every prompt, all served together through one cache (`attention`'s kernels)."""
    cache = make_cache(model, max_seqs=len(prompts), capacity=capacity, max_write=max_write, attention=attention)
    seqs = [cache.seq_new() for _ in prompts]
    fed = [0] * len(prompts)  # prompt tokens already in the cache
    outs: list[list[int]] = [[] for _ in prompts]
    live = set(range(len(prompts)))
    limit = sum(-(-len(p) // max_write) + n for p, n in zip(prompts, max_new, strict=True))  # chunks and tokens in turn
    for _ in range(limit + 1):
        if not live:
            break
        chunks, sample_rows, row = [], {}, 0
        for r in sorted(live):
            prompt = list(prompts[r])
            if fed[r] < len(prompt):
                tokens = prompt[fed[r] : fed[r] + max_write]
                samples = fed[r] + len(tokens) == len(prompt)
            else:
                tokens, samples = [outs[r][-1]], True
            start = cache.pos(seqs[r])
            chunks.append((seqs[r], tokens, text_idx(start, len(tokens))))
            fed[r] += len(tokens) if fed[r] < len(prompt) else 0
            row += len(tokens)
            if samples:
                sample_rows[r] = row - 1
        width = -(-row // bucket) * bucket
        logits = run_step(model, cache, chunks, width, rows=list(sample_rows.values()))
        for j, r in enumerate(sample_rows):
            token = int(logits[j].argmax())
            outs[r].append(token)
            if len(outs[r]) == max_new[r] or token in stop_ids:
                live.discard(r)
                cache.seq_rm(seqs[r])
    else:
        raise AssertionError(f"{limit} steps and prompts {sorted(live)} are still decoding")
    return outs
