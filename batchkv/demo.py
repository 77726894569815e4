"""A short tour of BatchControl: three sequences share one step, one forks, one rewinds."""

from __future__ import annotations

import torch

from batchkv.cache import BatchedSequenceCache, CacheConfig, LayerSpec


def demo(device: str = "cpu") -> None:
    """Drive a two-layer cache through a few steps and print what happened."""
    torch.manual_seed(0)
    cfg = CacheConfig(
        num_layers=2,
        kv_heads=2,
        head_dim=16,
        max_seqs=4,
        capacity=64,
        max_write=8,
        layers=(LayerSpec("flat"), LayerSpec("ring", window=8)),
        dtype=torch.float32,
    )
    cache = BatchedSequenceCache(cfg, device=device)
    print(f"cache: {cfg.num_layers} layers, {cfg.max_seqs} columns + scratch, {cache.nbytes} bytes, rows {cache.rows}")

    def step(ids: list[int], width: int) -> None:
        cache.declare_step(ids)
        cache.prepare_step(width)
        q = torch.randn(width, 4, 16)
        k, v = torch.randn(width, 2, 16), torch.randn(width, 2, 16)
        for layer in range(cfg.num_layers):
            out = cache.update_and_attend(layer, q, k, v)
        cache.commit_step()
        lengths = {s: cache.pos(s) for s in cache.sequences}
        print(f"step {ids} width {width}: padding rows zero={bool((out[len(ids) :] == 0).all())}, lengths {lengths}")

    a, b, c = cache.seq_new(), cache.seq_new(), cache.seq_new()
    step([a] * 5 + [b] * 3 + [c] * 2, width=12)
    for _ in range(3):
        step([a, b, c], width=4)
    fork = cache.seq_clone(a, upto=6)
    print(f"seq_clone({a}, upto=6) -> {fork} at {cache.pos(fork)}")
    cache.rewind(b, 4)
    print(f"rewind({b}, 4) -> {cache.pos(b)}; ring floor of {a} is {cache.ring_floor(a)}")
    cache.seq_rm(c)
    step([a, b, fork], width=4)
    print(f"seq_info after the last step:\n{cache.seq_info[:4].tolist()}")
