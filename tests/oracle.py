"""A naive oracle for BatchControl: each sequence's K/V in Python lists, attention by torch SDPA.

Nothing here knows about columns, rows, rings or slots. A ring layer is modelled as the flat history
with its window applied, which is exactly what the design promises the ring reproduces.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from batchkv.ops.reference import dequantize_fp8, quantize_fp8


class NaiveCache:
    def __init__(self, num_layers: int, windows: list[int]) -> None:
        self.windows = windows
        self.k: dict[int, list[list[torch.Tensor]]] = {}  # seq -> layer -> [Hkv, D] per position
        self.v: dict[int, list[list[torch.Tensor]]] = {}
        self.num_layers = num_layers

    def new(self, seq: int) -> None:
        self.k[seq] = [[] for _ in range(self.num_layers)]
        self.v[seq] = [[] for _ in range(self.num_layers)]

    def clone(self, src: int, dst: int, upto: int) -> None:
        self.k[dst] = [list(layer[:upto]) for layer in self.k[src]]
        self.v[dst] = [list(layer[:upto]) for layer in self.v[src]]

    def rewind(self, seq: int, n: int) -> None:
        for layer in range(self.num_layers):
            del self.k[seq][layer][n:]
            del self.v[seq][layer][n:]

    def rm(self, seq: int) -> None:
        del self.k[seq], self.v[seq]

    def length(self, seq: int) -> int:
        return len(self.k[seq][0])

    def step(
        self, layer: int, ids: list[int], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True
    ) -> torch.Tensor:
        """Append every token's K/V, then attend each query over its own history. q: [n, Hq, D]."""
        window = self.windows[layer]
        positions = []
        for i, seq in enumerate(ids):
            positions.append(len(self.k[seq][layer]))
            self.k[seq][layer].append(k[i])
            self.v[seq][layer].append(v[i])
        out = torch.empty_like(q, dtype=torch.float32)
        group = q.shape[1] // k.shape[1]
        for i, seq in enumerate(ids):
            keys = torch.stack(self.k[seq][layer]).float()  # [N, Hkv, D]
            values = torch.stack(self.v[seq][layer]).float()
            t = torch.arange(keys.shape[0])
            p = positions[i]
            if causal:
                allowed = t <= p
                if window:
                    allowed &= t > p - window
            else:
                end = max(pos + 1 for pos, s in zip(positions, ids, strict=True) if s == seq)
                allowed = t < end
                if window:
                    allowed &= t >= end - window
            out[i] = F.scaled_dot_product_attention(
                q[i].float()[:, None, :],  # [Hq, 1, D]
                keys.transpose(0, 1).repeat_interleave(group, 0),  # [Hq, N, D]
                values.transpose(0, 1).repeat_interleave(group, 0),
                attn_mask=allowed[None, None, :],
            )[:, 0, :]
        return out


def stored(cfg, x: torch.Tensor) -> torch.Tensor:
    """What a store of `cfg.kv_dtype` gives back for K or V rows x [n, Hkv, D]: x cast to it, or
    e4m3 codes times their scales (the oracle keeps exactly what the cache keeps)."""
    if cfg.quantized:
        return dequantize_fp8(*quantize_fp8(x))
    return x.to(cfg.kv_dtype).float()


class Pair:
    """Drives a BatchedSequenceCache and a NaiveCache with the same verbs and random tensors."""

    def __init__(self, cache, hq: int = 4, seed: int = 0) -> None:
        cfg = cache.config
        self.cache = cache
        self.hq = hq
        self.naive = NaiveCache(cfg.num_layers, [spec.window for spec in cfg.layers])
        self.gen = torch.Generator().manual_seed(seed)

    def new(self) -> int:
        seq = self.cache.seq_new()
        self.naive.new(seq)
        return seq

    def clone(self, src: int, upto: int | None = None) -> int:
        dst = self.cache.seq_clone(src, upto)
        self.naive.clone(src, dst, self.cache.pos(dst))
        return dst

    def rewind(self, seq: int, n: int) -> None:
        self.cache.rewind(seq, n)
        self.naive.rewind(seq, n)

    def rm(self, seq: int) -> None:
        self.cache.seq_rm(seq)
        self.naive.rm(seq)

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen, dtype=torch.float32)

    def step(self, ids: list[int], width: int | None = None, causal: bool = True, atol: float = 1e-5) -> list:
        """One full forward over every layer; checks each layer's output against the oracle."""
        cfg = self.cache.config
        width = width or len(ids)
        n = len(ids)
        self.cache.declare_step(ids)
        self.cache.prepare_step(width)
        outs = []
        for layer in range(cfg.num_layers):
            q = self.randn(width, self.hq, cfg.head_dim)
            k = self.randn(width, cfg.kv_heads, cfg.head_dim)
            v = self.randn(width, cfg.kv_heads, cfg.head_dim)
            out = self.cache.update_and_attend(layer, q, k, v, causal=causal)
            want = self.naive.step(layer, ids, q[:n], stored(cfg, k[:n]), stored(cfg, v[:n]), causal=causal)
            torch.testing.assert_close(out[:n].float(), want, atol=atol, rtol=1e-4)
            assert torch.equal(out[n:], torch.zeros_like(out[n:])), "padding rows must be exact zeros"
            outs.append(out)
        self.cache.commit_step()
        for seq in set(ids):
            assert self.cache.pos(seq) == self.naive.length(seq)
        return outs
