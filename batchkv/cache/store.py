"""The column store: per layer, K and V of shape [rows, C, Hkv, D] with C = `config.columns`
(max_seqs + 1 for the scratch column; max_seqs when steps are one token wide and never pad).

Position p of the sequence in column c lives at row `p % rows`, i.e. flat slot `(p % rows) * C + c`
of the `[rows * C, Hkv, D]` view. Flat layers grow by whole rows toward `capacity`; ring layers grow
with them until they hold their full `window + max_write - 1` rows, then stop.

Growth is atomic: every new buffer is built and filled first, then all are published in one
assignment and `generation` moves. A failed allocation leaves the store exactly as it was.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from batchkv.cache.config import CacheConfig

Allocator = Callable[..., torch.Tensor]


class ColumnStore:
    """K/V storage for every layer of a `CacheConfig`, on one device."""

    def __init__(self, config: CacheConfig, device: torch.device, alloc: Allocator = torch.empty) -> None:
        self.config = config
        self.device = device
        self._alloc = alloc  # tests inject failures here
        self.flat_rows = 0
        self.generation = 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.grow_to(config.rows_for(1))

    def rows(self, layer: int) -> int:
        return self.k[layer].shape[0]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def _new_layer(self, rows: int) -> torch.Tensor:
        cfg = self.config
        return self._alloc((rows, cfg.columns, cfg.kv_heads, cfg.head_dim), dtype=cfg.dtype, device=self.device)

    def grow_to(self, flat_rows: int) -> bool:
        """Reallocate so the flat layers hold `flat_rows` rows, keeping every stored position.

        Returns False when nothing had to move. Host side only; never inside a captured region.
        """
        if flat_rows <= self.flat_rows:
            return False
        cfg = self.config
        new_k: list[torch.Tensor] = []
        new_v: list[torch.Tensor] = []
        for layer in range(cfg.num_layers):
            rows = cfg.layer_rows(layer, flat_rows)
            old_rows = self.rows(layer) if self.k else 0
            if rows == old_rows:  # a full ring: nothing moves
                new_k.append(self.k[layer])
                new_v.append(self.v[layer])
                continue
            k, v = self._new_layer(rows), self._new_layer(rows)
            # Below the old row count nothing has wrapped (a ring grows only until it is full),
            # so position p sits at row p in both the old and the new buffer.
            if old_rows:
                k[:old_rows].copy_(self.k[layer])
                v[:old_rows].copy_(self.v[layer])
            new_k.append(k)
            new_v.append(v)
        # Publish in one step: a graph keyed on `generation` must never see new K beside old V.
        self.k, self.v, self.flat_rows = new_k, new_v, flat_rows
        self.generation += 1
        return True

    def copy_column(self, src: int, dst: int, upto: int) -> None:
        """Copy positions [0, upto) of column `src` into column `dst`, every layer, on the device.

        Rows [0, min(upto, rows)) suffice for a ring too: the caller refuses an `upto` below the
        ring floor, so every position the clone still reads sits in those rows.
        """
        for layer in range(self.config.num_layers):
            n = min(upto, self.rows(layer))
            if n:
                self.k[layer][:n, dst].copy_(self.k[layer][:n, src])
                self.v[layer][:n, dst].copy_(self.v[layer][:n, src])

    def flat_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[rows * C, Hkv, D] views of one layer's K and V, indexed by write slot."""
        k, v = self.k[layer], self.v[layer]
        return k.view(-1, *k.shape[2:]), v.view(-1, *v.shape[2:])

    def write_column(self, col: int, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write positions [0, n) of column `col` in `layer` from k, v [n, Hkv, D], on the device.

        Position p goes to row `p % rows`, so a ring keeps only the newest `rows` of them. K/V are
        cast to the store dtype and moved to its device on the copy.
        """
        rows, n = self.rows(layer), k.shape[0]
        lo = max(0, n - rows)
        if lo == 0:
            self.k[layer][:n, col].copy_(k)
            self.v[layer][:n, col].copy_(v)
            return
        at = torch.arange(lo, n, device=self.device) % rows
        self.k[layer][:, col].index_copy_(0, at, k[lo:].to(self.device, self.config.dtype))
        self.v[layer][:, col].index_copy_(0, at, v[lo:].to(self.device, self.config.dtype))
