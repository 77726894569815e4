"""Cache geometry: `LayerSpec` per layer and `CacheConfig` for the whole store.

Both are frozen and validated on construction, so a cache is never built from a geometry that
breaks a rule. Row counts follow from the config alone (`CacheConfig.rows_for` for a sequence's
extent, `CacheConfig.pool_rows_for` for a layer group's pool), which keeps growth predictable: the
same config always grows through the same row counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from batchkv.cache.rounding import KeyRounding
from batchkv.checks import int_arg, int_args
from batchkv.errors import ConfigError
from batchkv.ops.support import COMPUTE_DTYPES, SCALE_DTYPE, SCALE_PLANES, quantized, refusal

POLICIES = ("flat", "ring")
FIRST_ROWS = 256  # first extent (and pool) height when no bucket schedule is given; doubles from here
SCRATCH_ROWS = 16  # rows padded tokens write to (spread over a few rows; nothing reads them)
MAX_POSITIONS = 2**31 - 1  # kv_end and positions travel as int32 in seq_info
MAX_STEP_TOKENS = 1 << 20  # packed tokens of one step: sizes the static step buffers
ROTATE_E4M3_KEYS = False  # key_rotation=None on an e4m3 store: off, short of the accuracy target (docs)


@dataclass(frozen=True)
class LayerSpec:
    """How one layer stores and attends.

    policy="flat": every position is kept; `window > 0` still limits attention to the last
    `window` positions (a sliding window over flat storage).
    policy="ring": a sliding window of `window` positions over a ring of
    `min(capacity, window + max_write - 1)` rows; older positions are overwritten.
    """

    policy: str = "flat"
    window: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.policy, str) or self.policy not in POLICIES:
            raise ConfigError(f"LayerSpec.policy is {self.policy!r}; use one of {POLICIES}")
        why = " (0: no window, else a size in positions)"
        object.__setattr__(self, "window", int_arg("LayerSpec.window", self.window, 0, MAX_POSITIONS, why=why))
        if self.policy == "ring" and self.window == 0:
            raise ConfigError("LayerSpec(policy='ring') needs window > 0 (the ring holds a window)")


@dataclass(frozen=True)
class CacheConfig:
    """Geometry of a batched-sequence column store.

    num_layers, kv_heads, head_dim: the KV geometry of the model; head_dim is the width of the queries
        and keys (the QK dot's).
    value_dim: the width of the values (the PV dot's and the output's); 0 (default): head_dim.
        Multi-head latent attention expanded by transformers (DeepSeek-V2/V3, Kimi-K2) has keys of
        qk_nope + qk_rope = 192 and values of 128: each plane then holds its own width.
    max_seqs: resident sequences (columns: each owns one extent of consecutive rows per layer group).
    capacity: most positions one sequence may hold (at most 2**31 - 1: positions are int32 on the device).
    max_write: most tokens one sequence writes in one step (sizes ring layers).
    layers: one `LayerSpec` per layer; default all flat, no window.
    dtype: the K/V dtype of the model (fp16, bf16 or fp32): what the write takes and a read-back
        gives; also the storage dtype unless `kv_dtype` says otherwise.
    kv_dtype: storage dtype (default `dtype`: K/V are cast to it on write). `torch.float8_e4m3fn`
        stores e4m3 codes plus an fp32 scale per (position, KV head) beside them (see
        `batchkv.ops.support`): half the bytes of bf16 per position, and 3% for the scales.
    key_rotation: rotate q and k per head by a normalised Walsh-Hadamard matrix before e4m3
        quantisation (`batchkv.cache.rotation`; q . k and the output unchanged in exact arithmetic,
        less rounding error on a trained model's keys: docs/design.md has the numbers). None
        (default): `ROTATE_E4M3_KEYS` (off) for e4m3 stores of a power-of-two head_dim, off
        otherwise; True needs such a store.
    key_rounding: a `KeyRounding` (per-model calibration, `batchkv.score.calibrate_key_rounding`):
        e4m3 keys rounded channel by channel with query-weighted error feedback before the write
        (`batchkv.cache.rounding`); same codes and scales in form, so reads are unchanged. None
        (default): the write rounds each element to nearest. Needs an e4m3 store of its shape.
    max_segments: most runs in one step; default `2 * max_seqs`.
    max_width: most packed tokens in one step (static buffer size); default `max_seqs * max_write`,
        at most MAX_STEP_TOKENS.
    buckets, tail_step: row schedule of a sequence's extent when it grows (`rows_for`) and of a
        pool that grows on demand (`pool_rows_for`). Empty `buckets` doubles from 256; otherwise
        the first bucket that fits, then steps of `tail_step` past the last (0: past the last
        bucket, exactly the rows needed). An extent never exceeds `capacity` rows.
    pool_rows: rows of the flat layers' pool, every sequence's extent and the scratch rows
        together (ring layers' pools hold at most as many). 0: pools start at the schedule's first
        size and grow on demand (each growth moves storage: a new `generation`), up to every
        sequence at full capacity; > 0: allocated whole at construction and never grown, so a
        sequence that finds no room is refused instead.
    """

    num_layers: int
    kv_heads: int
    head_dim: int
    max_seqs: int
    capacity: int
    max_write: int = 1
    value_dim: int = 0
    layers: tuple[LayerSpec, ...] = ()
    dtype: torch.dtype = torch.bfloat16
    kv_dtype: torch.dtype | None = None
    key_rotation: bool | None = None
    key_rounding: KeyRounding | None = None
    max_segments: int = 0
    max_width: int = 0
    buckets: tuple[int, ...] = ()
    tail_step: int = 0
    pool_rows: int = 0
    _ring_rows: tuple[int, ...] = field(init=False, repr=False, compare=False, default=())

    def __post_init__(self) -> None:
        for name in ("num_layers", "kv_heads", "head_dim", "max_seqs", "capacity", "max_write"):
            object.__setattr__(self, name, int_arg(f"CacheConfig.{name}", getattr(self, name), 1, MAX_POSITIONS))
        for name in ("max_segments", "max_width", "tail_step", "pool_rows", "value_dim"):  # 0: the default
            object.__setattr__(self, name, int_arg(f"CacheConfig.{name}", getattr(self, name), 0, MAX_POSITIONS))
        buckets = int_args("CacheConfig.buckets", self.buckets, 1, MAX_POSITIONS)
        object.__setattr__(self, "buckets", buckets)
        if self.max_write > self.capacity:
            raise ConfigError(
                f"CacheConfig.max_write is {self.max_write} but capacity is {self.capacity}; "
                "one step cannot write more positions than a sequence holds"
            )
        if isinstance(self.layers, LayerSpec) or not hasattr(self.layers, "__iter__"):
            raise ConfigError(f"CacheConfig.layers is {self.layers!r}; give a tuple of LayerSpec, one per layer")
        layers = tuple(self.layers) or tuple(LayerSpec() for _ in range(self.num_layers))
        if len(layers) != self.num_layers:
            raise ConfigError(f"CacheConfig.layers has {len(layers)} entries for num_layers={self.num_layers}")
        if not all(isinstance(spec, LayerSpec) for spec in layers):
            raise ConfigError("CacheConfig.layers must hold LayerSpec entries")
        if self.dtype not in COMPUTE_DTYPES:
            raise ConfigError(f"CacheConfig.dtype is {self.dtype!r}; use torch.float16, bfloat16 or float32")
        kv_dtype = self.dtype if self.kv_dtype is None else self.kv_dtype
        value_dim = self.value_dim or self.head_dim
        problem = refusal(kv_dtype, self.head_dim, backend="reference", value_dim=value_dim)
        if problem:
            raise ConfigError(f"CacheConfig: {problem}")
        if self.key_rotation not in (None, True, False):
            raise ConfigError(f"CacheConfig.key_rotation is {self.key_rotation!r}; use None (auto), True or False")
        power_of_two = self.head_dim & (self.head_dim - 1) == 0  # a Walsh-Hadamard size
        if self.key_rotation and not (quantized(kv_dtype) and power_of_two):
            raise ConfigError(
                f"CacheConfig.key_rotation=True needs an e4m3 store and a power-of-two head_dim; "
                f"kv_dtype is {kv_dtype}, head_dim {self.head_dim} (use key_rotation=None or False)"
            )
        if self.key_rounding is not None:
            want = (self.num_layers, self.kv_heads, self.head_dim)
            if not isinstance(self.key_rounding, KeyRounding) or not quantized(kv_dtype):
                raise ConfigError(
                    f"CacheConfig.key_rounding needs a KeyRounding and an e4m3 store; got "
                    f"{type(self.key_rounding).__name__} with kv_dtype {kv_dtype} (use key_rounding=None)"
                )
            if self.key_rounding.shape() != want:
                raise ConfigError(
                    f"CacheConfig.key_rounding is for (layers, kv_heads, head_dim) {self.key_rounding.shape()}; "
                    f"this store is {want} (calibrate it on this model)"
                )
        rotate = quantized(kv_dtype) and power_of_two and ROTATE_E4M3_KEYS
        key_rotation = rotate if self.key_rotation is None else self.key_rotation
        max_segments = self.max_segments or 2 * self.max_seqs
        if max_segments < self.max_seqs:
            raise ConfigError(f"CacheConfig.max_segments is {max_segments}; it must be >= max_seqs ({self.max_seqs})")
        max_width = self.max_width or min(self.max_seqs * self.max_write, MAX_STEP_TOKENS)
        if max_width > MAX_STEP_TOKENS:
            raise ConfigError(f"CacheConfig.max_width is {max_width}; one step packs at most {MAX_STEP_TOKENS} tokens")
        scratch = min(SCRATCH_ROWS, max_width) if max_width > 1 else 0
        if self.pool_rows and self.pool_rows <= scratch:
            raise ConfigError(
                f"CacheConfig.pool_rows is {self.pool_rows}; it must hold the {scratch} scratch rows and at least "
                "one position (0: grow on demand)"
            )
        if list(buckets) != sorted(set(buckets)):
            raise ConfigError(f"CacheConfig.buckets {buckets} must be strictly increasing")
        ring_rows = tuple(
            min(self.capacity, spec.window + self.max_write - 1) if spec.policy == "ring" else 0 for spec in layers
        )
        object.__setattr__(self, "layers", layers)
        object.__setattr__(self, "value_dim", value_dim)
        object.__setattr__(self, "kv_dtype", kv_dtype)
        object.__setattr__(self, "key_rotation", key_rotation)
        object.__setattr__(self, "max_segments", max_segments)
        object.__setattr__(self, "max_width", max_width)
        object.__setattr__(self, "_ring_rows", ring_rows)

    @property
    def scratch_rows(self) -> int:
        """Rows of every pool that padded tokens write to (no segment reads them); none when
        max_width is 1: a one-token step never pads."""
        return min(SCRATCH_ROWS, self.max_width) if self.max_width > 1 else 0

    def ring_rows(self, layer: int) -> int:
        """Full row count of a ring layer (0 for a flat layer)."""
        return self._ring_rows[layer]

    def rows_for(self, needed: int) -> int:
        """Rows of a sequence's extent that holds `needed` positions (never past capacity)."""
        return min(self._schedule(needed), self.capacity)

    def pool_rows_for(self, needed: int, ring: int = 0) -> int:
        """Rows a pool that grows on demand takes to hold `needed` rows: the row schedule, never past
        the most its extents can hold (`max_pool_rows`)."""
        return min(max(self._schedule(needed), needed), self.max_pool_rows(ring))

    def max_pool_rows(self, ring: int = 0) -> int:
        """Rows of a pool holding every sequence at full capacity (a ring group: full rings) and the
        scratch rows; at most `pool_rows` rows when that is set."""
        full = self.max_seqs * (min(ring, self.capacity) if ring else self.capacity) + self.scratch_rows
        return min(full, self.pool_rows) if self.pool_rows else full

    def _schedule(self, needed: int) -> int:
        needed = max(1, needed)
        if not self.buckets:
            rows = FIRST_ROWS
            while rows < needed:
                rows *= 2
            return rows
        for bucket in self.buckets:
            if needed <= bucket:
                return bucket
        last = self.buckets[-1]
        if self.tail_step == 0:
            return max(last, needed)
        return last + -(-(needed - last) // self.tail_step) * self.tail_step

    def layer_rows(self, layer: int, flat_rows: int) -> int:
        """Rows of a sequence's extent in `layer` while its flat extent has `flat_rows`: a ring
        grows with it until full."""
        ring = self._ring_rows[layer]
        return min(ring, flat_rows) if ring else flat_rows

    @property
    def quantized(self) -> bool:
        """True when K/V are stored as e4m3 codes with a scale per (position, KV head)."""
        return quantized(self.kv_dtype)

    @property
    def planes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Storage planes of every layer: name -> (shape after the row axis, dtype).

        k: (1, Hkv, head_dim), v: (1, Hkv, value_dim) in kv_dtype; for e4m3 storage also k_scale,
        v_scale: (1, Hkv) fp32 (one scale per row of either width). The
        axis of size 1 is the kernels' column axis: a pool is one column whose rows the sequences'
        extents share (a segment's `col` is its extent's first row). Every plane is indexed by row
        first, so growth, clones and writes treat them alike (scale planes are stored rows last,
        `batchkv.ops.support.empty_scales`, and viewed so).
        """
        row = (1, self.kv_heads, self.head_dim)
        planes = {"k": (row, self.kv_dtype), "v": ((1, self.kv_heads, self.value_dim), self.kv_dtype)}
        if self.quantized:
            planes |= {name: (row[:2], SCALE_DTYPE) for name in SCALE_PLANES}
        return planes

    def bytes_per_position(self) -> int:
        """Bytes one position of one sequence takes in every layer's planes (K, V and any scales)."""
        return self.num_layers * self.layer_row_bytes()

    def layer_row_bytes(self) -> int:
        """Bytes one row (one position of one sequence) of one layer's planes takes."""
        return sum(math.prod(shape) * dtype.itemsize for shape, dtype in self.planes.values())
