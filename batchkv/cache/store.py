"""The column store: per layer group, one pool of rows that the sequences' extents share.

Layers with the same ring size form a group (flat layers are one group). A group's layers each
hold planes of shape [P, 1, Hkv, D] (K, V; for e4m3 storage also fp32 scales [P, 1, Hkv]), P the
group's pool rows, and a `RowPool` says which rows each sequence owns: an *extent* of consecutive
rows, as tall as the sequence's reach (a ring layer's at most its ring). Position p of a sequence
whose extent in a group starts at row `base` and has `rows` rows lives at row `base + p % rows`,
so its keys are one contiguous run of rows, which the kernels read with no block table. The axis
of size 1 is the kernels' column axis: a segment's `col` is its extent's first row.

Scale planes are views of [1, Hkv, P] storage (`empty_scales`: the attention kernels read a
sequence's scales contiguously), so nothing here may assume a plane is contiguous.

Memory follows reach: an extent costs what its sequence can reach, not what the longest sequence
can. Extents are placed best-fit, grow in place when they can, move when they cannot, and return
their rows when freed; when the free rows are scattered, every extent slides down (compaction).
None of that changes an address a captured graph holds: extents' bases travel in `seq_info` and
the write slots, staged per step. Only a pool's growth (a pool allocated on demand that fills up)
moves storage: it is atomic (every new buffer is built and filled first, then all are published in
one assignment and `generation` moves), and a failed allocation leaves the store exactly as it was.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from batchkv.cache.config import CacheConfig
from batchkv.cache.pool import Move, RowPool
from batchkv.checks import allocating
from batchkv.errors import CapacityError
from batchkv.ops.reference import dequantize_fp8, index_copy, quantize_fp8
from batchkv.ops.support import SCALE_PLANES, empty_scales

Allocator = Callable[..., torch.Tensor]
SCRATCH = "scratch"  # the scratch extent's key
MOVING = "moving"  # (MOVING, key): an extent's new rows while its old ones are still held
MOVE_CHUNK = 4096  # rows per copy when an extent slides over itself (each through a temporary)


@dataclass
class LayerGroup:
    """Layers that share a ring size (0: flat) and so a pool: which rows each extent owns."""

    ring: int
    layers: list[int]
    pool: RowPool

    def extent_rows(self, height: int) -> int:
        """Rows of an extent in this group for a sequence whose flat extent has `height` rows."""
        return min(self.ring, height) if self.ring else height


class ColumnStore:
    """Storage planes of every layer of a `CacheConfig` on one device, and the extents in them."""

    FIX = "lower max_seqs or capacity, or free device memory"  # what a failed allocation advises

    def __init__(self, config: CacheConfig, device: torch.device, alloc: Allocator = torch.empty) -> None:
        self.config = config
        self.device = device
        self._alloc = alloc  # tests inject failures here
        self.generation = 0
        rings = sorted({config.ring_rows(layer) for layer in range(config.num_layers)})
        self.groups = [LayerGroup(ring, [], RowPool(0, config.max_seqs)) for ring in rings]
        self.group_of = [rings.index(config.ring_rows(layer)) for layer in range(config.num_layers)]
        for layer, g in enumerate(self.group_of):
            self.groups[g].layers.append(layer)
        self.planes: dict[str, list[torch.Tensor]] = {name: [] for name in config.planes}  # name -> per layer
        first, scratch = config.rows_for(1), config.scratch_rows  # room for the scratch rows and one sequence
        fixed = config.pool_rows > 0
        sizes = [
            config.max_pool_rows(g.ring) if fixed else config.pool_rows_for(g.extent_rows(first) + scratch, g.ring)
            for g in self.groups
        ]
        self._grow(sizes, f"the first {sizes[0]} rows of K/V")
        if scratch:
            for group in self.groups:
                assert group.pool.place(SCRATCH, scratch) == 0

    # ---- geometry -----------------------------------------------------------------------------
    @property
    def k(self) -> list[torch.Tensor]:
        return self.planes["k"]

    @property
    def v(self) -> list[torch.Tensor]:
        return self.planes["v"]

    def pool_rows(self, group: int = 0) -> int:
        return self.groups[group].pool.size

    def layer(self, layer: int) -> dict[str, torch.Tensor]:
        """Every plane of one layer by name: k, v [P, 1, Hkv, D] (+ k_scale, v_scale [P, 1, Hkv])."""
        return {name: tensors[layer] for name, tensors in self.planes.items()}

    def modulus(self, layer: int) -> int:
        """The kernels' `rows` for `layer`: key t of an extent sits at row `base + t % rows`. A ring
        layer's full ring (a shorter extent never wraps), else the pool's rows (no extent is taller)."""
        group = self.groups[self.group_of[layer]]
        return group.ring or min(self.config.capacity, group.pool.size)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for tensors in self.planes.values() for t in tensors)

    def base(self, group: int, key: object) -> int:
        return self.groups[group].pool.base(key)

    def rows(self, group: int, key: object) -> int:
        return self.groups[group].pool.rows(key)

    def free_rows(self) -> int:
        """Rows the flat pool can still give (with the growth a pool allocated on demand has left)."""
        pool = self.groups[-1].pool if self.groups[0].ring else self.groups[0].pool
        growth = 0 if self.config.pool_rows else self.config.max_pool_rows() - pool.size
        return pool.free + growth

    # ---- extents (host side; never inside a captured region) ----------------------------------
    def place(self, key: object, height: int) -> None:
        """Give `key` extents for a flat height of `height` rows in every group (growing a pool
        first when it must). A refusal (CapacityError) changes nothing."""
        self._make_room({g: group.extent_rows(height) for g, group in enumerate(self.groups)})
        for group in self.groups:
            rows = group.extent_rows(height)
            if group.pool.place(key, rows) is None:
                self._compact(group)
                group.pool.place(key, rows)

    def resize(self, heights: dict[object, int], keep: dict[object, int]) -> None:
        """Grow each key's extents to the flat height `heights[key]`, keeping its positions
        [0, keep[key]): in place, or moved to new rows. The pools grow first, once, for all of them,
        so a refusal (CapacityError) changes nothing."""
        extra: dict[int, int] = {}
        for g, group in enumerate(self.groups):
            for key, height in heights.items():
                more = group.extent_rows(height) - group.pool.rows(key)
                if more > 0:
                    extra[g] = extra.get(g, 0) + more
        self._make_room(extra)
        for key, height in heights.items():
            for group in self.groups:
                self._resize_extent(group, key, group.extent_rows(height), keep[key])

    def _resize_extent(self, group: LayerGroup, key: object, rows: int, keep: int) -> None:
        pool = group.pool
        more = rows - pool.rows(key)
        if more <= 0 or pool.extend(key, rows):
            return
        # Below the old extent's rows nothing has wrapped (a ring extent grows only until full), so
        # position p sits at row p of the old extent and of the new one.
        moving = (MOVING, key)
        if pool.place(moving, rows) is not None:  # rows elsewhere, while the old ones are held
            self._copy_rows(group, pool.base(key), pool.base(moving), min(keep, pool.rows(key)))
            pool.release(key)
            pool.rename(moving, key)
            return
        self._apply(group, pool.compaction())
        self._apply(group, pool.opening(key, more))
        assert pool.extend(key, rows)

    def release(self, key: object) -> None:
        for group in self.groups:
            group.pool.release(key)

    def copy_prefix(self, src: object, dst: object, upto: int) -> None:
        """Copy positions [0, upto) of `src` into `dst` (another extent), every layer and plane.

        Rows [0, min(upto, rows)) suffice for a ring too: the caller refuses an `upto` below the
        ring floor, so every position the clone still reads sits in those rows."""
        for group in self.groups:
            n = min(upto, group.pool.rows(src), group.pool.rows(dst))
            self._copy_rows(group, group.pool.base(src), group.pool.base(dst), n)

    def extent(self, key: object, layer: int) -> dict[str, torch.Tensor]:
        """Views of `key`'s rows in `layer`'s planes: k, v [rows, Hkv, D] (+ k_scale, v_scale
        [rows, Hkv]); position p is at row p % rows."""
        group = self.group_of[layer]
        base, rows = self.base(group, key), self.rows(group, key)
        return {name: plane[base : base + rows, 0] for name, plane in self.layer(layer).items()}

    def write_column(self, key: object, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write positions [0, n) of `key` in `layer` from k, v [n, Hkv, D], on the device.

        Position p goes to row `p % rows` of the extent, so a ring keeps only the newest `rows` of
        them. K/V are encoded for storage (cast, or quantised to e4m3 with scales) and moved to its
        device."""
        planes = self.extent(key, layer)
        rows, n = planes["k"].shape[0], k.shape[0]
        lo = max(0, n - rows)
        at = torch.arange(lo, n, device=self.device) % rows
        for name, values in self.encode(k[lo:], v[lo:]).items():
            index_copy(planes[name], at, values)

    def read_column(self, key: object, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions [0, n) of `key` in `layer` (n <= its rows), as K, V [n, Hkv, D] in the config's
        dtype: e4m3 storage is dequantised. A device copy; host side."""
        planes, dtype = self.extent(key, layer), self.config.dtype
        if not self.config.quantized:
            return planes["k"][:n].to(dtype), planes["v"][:n].to(dtype)
        return tuple(  # type: ignore[return-value]
            dequantize_fp8(planes[name][:n], planes[f"{name}_scale"][:n], dtype) for name in ("k", "v")
        )

    def encode(self, k: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
        """K/V [n, Hkv, D] as the planes store them: cast, or e4m3 codes and fp32 scales [n, Hkv]."""
        cfg = self.config
        if not cfg.quantized:
            return {"k": k.to(self.device, cfg.kv_dtype), "v": v.to(self.device, cfg.kv_dtype)}
        (k_codes, k_scale), (v_codes, v_scale) = (quantize_fp8(x.to(self.device)) for x in (k, v))
        return {"k": k_codes, "v": v_codes, "k_scale": k_scale, "v_scale": v_scale}

    def write_views(self, layer: int) -> dict[str, torch.Tensor]:
        """One layer's planes as the K/V write takes them: k, v viewed [P, Hkv, D] (indexed by write
        slot, a row of the pool); k_scale, v_scale as they are, [P, 1, Hkv] (slot s is [s, 0])."""
        return {
            name: plane if name in SCALE_PLANES else plane.view(-1, *plane.shape[2:])
            for name, plane in self.layer(layer).items()
        }

    # ---- internals ----------------------------------------------------------------------------
    def _make_room(self, need: dict[int, int]) -> None:
        """Grow the pools that cannot give `need[g]` more rows, all in one publication. A fixed pool
        (`pool_rows`) never grows: CapacityError."""
        cfg, sizes, short = self.config, [], []
        for g, group in enumerate(self.groups):
            pool, extra = group.pool, need.get(g, 0)
            size = pool.size
            if extra > pool.free:
                size = cfg.pool_rows_for(pool.used + extra, group.ring)
                if cfg.pool_rows or size < pool.used + extra:
                    short.append((g, extra))
            sizes.append(size)
        if short:
            g, extra = short[0]
            pool = self.groups[g].pool
            raise CapacityError(
                f"the K/V store has {pool.free} free rows of {pool.size} and cannot give {extra} more "
                f"({'pool_rows is fixed' if cfg.pool_rows else 'every sequence at capacity'}); finish or "
                "remove sequences, or give the store more rows"
            )
        if sizes != [group.pool.size for group in self.groups]:
            self._grow(sizes, "growing the store (the cache is unchanged)")

    def _grow(self, sizes: list[int], what: str) -> None:
        """Reallocate every group whose pool is to have more rows, keeping every stored row."""
        cfg = self.config
        nbytes = sum(sizes[g] * len(group.layers) for g, group in enumerate(self.groups)) * cfg.layer_row_bytes()
        new: dict[str, list[torch.Tensor]] = {name: [] for name in self.planes}
        with allocating(what, nbytes, self.FIX):
            for layer, g in enumerate(self.group_of):
                rows, old_rows = sizes[g], self.groups[g].pool.size
                for name, (shape, dtype) in cfg.planes.items():
                    if rows == old_rows:
                        new[name].append(self.planes[name][layer])
                        continue
                    if name in SCALE_PLANES:  # [P, 1, Hkv] viewing [1, Hkv, P] storage
                        plane = empty_scales(rows, *shape, device=self.device, alloc=self._alloc)
                    else:
                        plane = self._alloc((rows, *shape), dtype=dtype, device=self.device)
                    if old_rows:
                        plane[:old_rows].copy_(self.planes[name][layer])
                    new[name].append(plane)
        # Publish in one step: a graph keyed on `generation` must never see new K beside old V.
        self.planes = new
        for group, size in zip(self.groups, sizes, strict=True):
            group.pool.resize(size)
        self.generation += 1

    def _compact(self, group: LayerGroup) -> None:
        """Slide every extent of `group` down so its free rows form one hole at the top."""
        self._apply(group, group.pool.compaction())

    def _apply(self, group: LayerGroup, moves: list[Move]) -> None:
        """Carry out `moves` in order on every plane of the group's layers, then record them."""
        for move in moves:
            self._move(group, move)
        group.pool.apply(moves)

    def _move(self, group: LayerGroup, move: Move) -> None:
        distance = abs(move.src - move.dst)
        if distance >= move.rows:
            self._copy_rows(group, move.src, move.dst, move.rows)
            return
        # The ranges overlap: chunks through a temporary, from the end the move leaves first, so a
        # chunk never overwrites rows a later chunk still reads.
        chunk = max(distance, MOVE_CHUNK)
        offsets = range(0, move.rows, chunk)
        for off in offsets if move.dst < move.src else reversed(offsets):
            n = min(chunk, move.rows - off)
            for layer in group.layers:
                for plane in self.layer(layer).values():
                    rows = plane[move.src + off : move.src + off + n].clone()
                    plane[move.dst + off : move.dst + off + n].copy_(rows)

    def _copy_rows(self, group: LayerGroup, src: int, dst: int, n: int) -> None:
        """Rows [src, src + n) to [dst, dst + n) of every plane of the group's layers (disjoint ranges)."""
        if n <= 0 or src == dst:
            return
        for layer in group.layers:
            for plane in self.layer(layer).values():
                plane[dst : dst + n].copy_(plane[src : src + n])
