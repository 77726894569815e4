"""The column store: per layer, K and V of shape [rows, C, Hkv, D] with C = `config.columns`
(max_seqs + 1 for the scratch column; max_seqs when steps are one token wide and never pad), and
for e4m3 storage their fp32 scales [rows, C, Hkv]: the config's *planes*, every one indexed by
row first. Growth, clones and writes loop over the planes, so a scale always moves with its row.
Scale planes are views of [C, Hkv, rows] storage (`empty_scales`: the attention kernels read a
(column, head)'s scales contiguously), so nothing here may assume a plane is contiguous.

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
from batchkv.ops.reference import dequantize_fp8, index_copy, quantize_fp8
from batchkv.ops.support import SCALE_PLANES, empty_scales

Allocator = Callable[..., torch.Tensor]


class ColumnStore:
    """Storage planes (K, V and, for e4m3, their scales) of every layer of a `CacheConfig`, on one device."""

    def __init__(self, config: CacheConfig, device: torch.device, alloc: Allocator = torch.empty) -> None:
        self.config = config
        self.device = device
        self._alloc = alloc  # tests inject failures here
        self.flat_rows = 0
        self.generation = 0
        self.planes: dict[str, list[torch.Tensor]] = {name: [] for name in config.planes}  # name -> per layer
        self.grow_to(config.rows_for(1))

    @property
    def k(self) -> list[torch.Tensor]:
        return self.planes["k"]

    @property
    def v(self) -> list[torch.Tensor]:
        return self.planes["v"]

    def rows(self, layer: int) -> int:
        return self.k[layer].shape[0]

    def layer(self, layer: int) -> dict[str, torch.Tensor]:
        """Every plane of one layer by name: k, v [rows, C, Hkv, D] (+ k_scale, v_scale [rows, C, Hkv])."""
        return {name: tensors[layer] for name, tensors in self.planes.items()}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for tensors in self.planes.values() for t in tensors)

    def grow_to(self, flat_rows: int) -> bool:
        """Reallocate so the flat layers hold `flat_rows` rows, keeping every stored position.

        Returns False when nothing had to move. Host side only; never inside a captured region.
        """
        if flat_rows <= self.flat_rows:
            return False
        cfg = self.config
        new: dict[str, list[torch.Tensor]] = {name: [] for name in self.planes}
        for layer in range(cfg.num_layers):
            rows = cfg.layer_rows(layer, flat_rows)
            old_rows = self.rows(layer) if self.k else 0
            for name, (shape, dtype) in cfg.planes.items():
                if rows == old_rows:  # a full ring: nothing moves
                    new[name].append(self.planes[name][layer])
                    continue
                if name in SCALE_PLANES:  # [rows, C, Hkv] viewing [C, Hkv, rows] storage
                    plane = empty_scales(rows, *shape, device=self.device, alloc=self._alloc)
                else:
                    plane = self._alloc((rows, *shape), dtype=dtype, device=self.device)
                # Below the old row count nothing has wrapped (a ring grows only until it is full),
                # so position p sits at row p in both the old and the new buffer.
                if old_rows:
                    plane[:old_rows].copy_(self.planes[name][layer])
                new[name].append(plane)
        # Publish in one step: a graph keyed on `generation` must never see new K beside old V.
        self.planes, self.flat_rows = new, flat_rows
        self.generation += 1
        return True

    def copy_column(self, src: int, dst: int, upto: int) -> None:
        """Copy positions [0, upto) of column `src` into column `dst`, every layer and plane, on the device.

        Rows [0, min(upto, rows)) suffice for a ring too: the caller refuses an `upto` below the
        ring floor, so every position the clone still reads sits in those rows.
        """
        for layer in range(self.config.num_layers):
            n = min(upto, self.rows(layer))
            for plane in self.layer(layer).values():
                if n:
                    plane[:n, dst].copy_(plane[:n, src])

    def write_views(self, layer: int) -> dict[str, torch.Tensor]:
        """One layer's planes as the K/V write takes them: k, v viewed [rows * C, Hkv, D] (indexed
        by write slot); k_scale, v_scale as they are, [rows, C, Hkv] (slot s is [s // C, s % C])."""
        return {
            name: plane if name in SCALE_PLANES else plane.view(-1, *plane.shape[2:])
            for name, plane in self.layer(layer).items()
        }

    def encode(self, k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
        """K/V [n, Hkv, D] as the planes store them: cast, or e4m3 codes and fp32 scales [n, Hkv]."""
        cfg = self.config
        if not cfg.quantized:
            return {"k": k.to(self.device, cfg.kv_dtype), "v": v.to(self.device, cfg.kv_dtype)}
        (k_codes, k_scale), (v_codes, v_scale) = (quantize_fp8(x.to(self.device)) for x in (k, v))
        return {"k": k_codes, "v": v_codes, "k_scale": k_scale, "v_scale": v_scale}

    def write_column(self, col: int, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write positions [0, n) of column `col` in `layer` from k, v [n, Hkv, D], on the device.

        Position p goes to row `p % rows`, so a ring keeps only the newest `rows` of them. K/V are
        encoded for storage (cast, or quantised to e4m3 with scales) and moved to its device.
        """
        rows, n = self.rows(layer), k.shape[0]
        lo = max(0, n - rows)
        at = torch.arange(lo, n, device=self.device) % rows
        planes = self.layer(layer)
        for name, values in self.encode(k[lo:], v[lo:]).items():
            index_copy(planes[name].select(1, col), at, values)

    def read_column(self, col: int, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions [0, n) of column `col` in `layer` (n <= rows), as K, V [n, Hkv, D] in the
        config's dtype: e4m3 storage is dequantised. A device copy; host side."""
        planes, dtype = self.layer(layer), self.config.dtype
        if not self.config.quantized:
            return planes["k"][:n, col].to(dtype), planes["v"][:n, col].to(dtype)
        return tuple(  # type: ignore[return-value]
            dequantize_fp8(planes[name][:n, col], planes[f"{name}_scale"][:n, col], dtype) for name in ("k", "v")
        )
