"""The manifest schema: msgspec Structs, strict, checked whole on construction and on decode.

A `Manifest` always holds a valid manifest: `__post_init__` checks every type, bound and rule,
whether the object came from `msgspec` decoding, from `Manifest(...)` or from
`msgspec.structs.replace`. Each refusal is a `ManifestError` naming the JSON path of the field and
the rule (`$.layers[3].window: a ring layer needs window > 0`).

Layout-specific fields are optional and refused on the other layouts: `batched-sequence` takes
`max_seqs` (required), `max_segments` (default `2 * max_seqs`) and `causal` (default true); `cell`
takes `max_cells` (required). Absent optional fields are `UNSET` and stay absent when encoded, so a
file round-trips byte for byte.

Sizes are bounded (the constants below), so a hostile file cannot make the runtime plan absurd
buffers: every dimension has a ceiling, and so do the tokens of one step and the K/V bytes at full
capacity.
"""

from __future__ import annotations

import json
import re
from typing import Literal

from msgspec import UNSET, Struct, UnsetType

from batchkv.cache.config import MAX_STEP_TOKENS as CACHE_MAX_STEP_TOKENS
from batchkv.cache.config import SCRATCH_ROWS
from batchkv.dtypes import MODEL_DTYPES, STORAGE_DTYPES, dtype_bytes
from batchkv.errors import ManifestError

VERSION = 1
LAYOUTS = ("sequence", "cell", "batched-sequence")
POLICIES = ("flat", "ring")
DTYPE_BYTES = {name: dtype_bytes(name) for name in MODEL_DTYPES}  # model K/V dtypes (`dtype`)
KV_DTYPE_BYTES = {name: dtype_bytes(name) for name in STORAGE_DTYPES}  # storage dtypes (`kv_dtype`)
SCALE_BYTES = {"float8_e4m3fn": 4}  # an fp32 scale per (position, KV head) beside e4m3 K and V

# Ceilings: far above any model or accelerator in use, far below what would exhaust a host.
MAX_LAYERS = 1024
MAX_KV_HEADS = 256
MAX_HEAD_DIM = 1024
MAX_CAPACITY = 1 << 24  # positions per sequence (16 Mi)
MAX_SEQS = 4096
MAX_SEGMENTS = 1 << 16
MAX_CELLS = 1 << 26
MAX_STEP_TOKENS = CACHE_MAX_STEP_TOKENS  # max_seqs * max_write: sizes the static step buffers
MAX_SAMPLE_ROWS = 4096
MAX_WIDTHS = 256
MAX_MODEL_NAME = 128
MAX_KV_BYTES = 1 << 40  # 1 TiB of K/V at full capacity: more than any one accelerator node holds

# Fields only one layout takes, and that layout.
LAYOUT_FIELDS = {
    "max_seqs": "batched-sequence",
    "max_segments": "batched-sequence",
    "causal": "batched-sequence",
    "max_cells": "cell",
}


class Layer(Struct, frozen=True, forbid_unknown_fields=True):
    """One layer's storage: `policy` "flat" keeps every position; "ring" keeps a sliding window of
    `window` positions in `min(capacity, window + max_write - 1)` rows. `window` 0 means none."""

    layer_id: int
    policy: Literal["flat", "ring"]
    window: int = 0


class Manifest(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """An exported cache's geometry (DESIGN.md, Manifests). Field order is the encoded key order.

    `dtype` is the model's K/V dtype; `kv_dtype` the storage dtype (default `dtype`), where
    "float8_e4m3fn" stores e4m3 codes plus an fp32 scale per (position, KV head).

    `causal` (batched-sequence) records whether the exported model attends causally; the cache
    takes causality per `update_and_attend` call, so whoever drives the model passes it (the
    executor's models are causal; a draft model exported with causal=false passes False).
    """

    version: int
    layout: Literal["sequence", "cell", "batched-sequence"]
    model: str | UnsetType = UNSET
    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: Literal["bfloat16", "float16", "float32"]
    kv_dtype: Literal["bfloat16", "float16", "float32", "float8_e4m3fn"] | UnsetType = UNSET
    maximum_capacity: int
    max_write: int
    max_seqs: int | UnsetType = UNSET
    max_segments: int | UnsetType = UNSET
    causal: bool | UnsetType = UNSET
    max_cells: int | UnsetType = UNSET
    max_sample_rows: int = 64
    step_widths: tuple[int, ...] = ()
    layers: tuple[Layer, ...]

    def __post_init__(self) -> None:
        _check(self)

    # ---- derived geometry (valid because every instance passed `_check`) ----------------------
    @property
    def sequences(self) -> int:
        """Sequences resident at once: `max_seqs`, 1 for `sequence`, 0 for a `cell` pool."""
        if self.layout == "cell":
            return 0
        return self.max_seqs if isinstance(self.max_seqs, int) else 1

    @property
    def segments(self) -> int:
        """Most runs in one step: `max_segments`, default `2 * sequences`."""
        return self.max_segments if isinstance(self.max_segments, int) else 2 * self.sequences

    @property
    def is_causal(self) -> bool:
        """The `causal` to pass to `update_and_attend` for this model (default true)."""
        return self.causal if isinstance(self.causal, bool) else True

    @property
    def scratch_rows(self) -> int:
        """Rows of each layer's pool that padded tokens write to (`CacheConfig.scratch_rows`'s rule);
        none for a cell pool or a store whose steps are one token wide (it can never pad)."""
        if self.layout == "cell" or self.step_tokens <= 1:
            return 0
        return min(SCRATCH_ROWS, self.step_tokens)

    @property
    def step_tokens(self) -> int:
        """Most tokens one step writes: `max_write` per resident sequence (per step for a cell pool)."""
        return self.max_write * max(1, self.sequences)

    def layer(self, layer_id: int) -> Layer:
        """The entry with this `layer_id`."""
        return next(entry for entry in self.layers if entry.layer_id == layer_id)

    def rows(self, layer_id: int) -> int:
        """Rows one sequence holds in a layer at full capacity: capacity (flat), min(capacity, window +
        max_write - 1) (ring), or `max_cells` (cell pool, every layer, all sequences together)."""
        if self.layout == "cell":
            return self.max_cells  # type: ignore[return-value]
        return _layer_rows(self.layer(layer_id), self.maximum_capacity, self.max_write)

    def pool_rows(self, layer_id: int) -> int:
        """Rows of a layer's pool with every sequence at full capacity, and the scratch rows."""
        if self.layout == "cell":
            return self.max_cells  # type: ignore[return-value]
        return self.sequences * self.rows(layer_id) + self.scratch_rows

    @property
    def storage_dtype(self) -> str:
        """The K/V storage dtype: `kv_dtype`, default `dtype`."""
        return self.kv_dtype if isinstance(self.kv_dtype, str) else self.dtype

    @property
    def bytes_per_token(self) -> int:
        """K+V bytes of one position of one sequence across every layer, scales included."""
        kv = self.storage_dtype
        return 2 * self.num_layers * self.kv_heads * (self.head_dim * KV_DTYPE_BYTES[kv] + SCALE_BYTES.get(kv, 0))

    @property
    def kv_bytes(self) -> int:
        """K+V bytes with every layer at its full rows (the most the cache ever allocates)."""
        return _kv_bytes(self, {entry.layer_id: entry for entry in self.layers})


def _kv_bytes(m: Manifest, by_id: dict[int, Layer]) -> int:
    per_row = m.bytes_per_token // m.num_layers  # one position of one layer
    if m.layout == "cell":
        return m.num_layers * m.max_cells * per_row  # type: ignore[operator]
    rows = sum(_layer_rows(entry, m.maximum_capacity, m.max_write) for entry in by_id.values())
    return (m.sequences * rows + m.scratch_rows * len(by_id)) * per_row


def _layer_rows(entry: Layer, capacity: int, max_write: int) -> int:
    """Rows of a batched layer at full capacity: capacity (flat) or min(capacity, window + max_write - 1) (ring)."""
    return min(capacity, entry.window + max_write - 1) if entry.policy == "ring" else capacity


# ---- the checks ---------------------------------------------------------------------------------
def _int(path: str, value: object, lo: int, hi: int, why: str = "") -> int:
    if type(value) is not int:
        raise ManifestError(path, f"expected an integer, got {type(value).__name__} {value!r}")
    if not lo <= value <= hi:
        raise ManifestError(path, f"must be in [{lo}, {hi}]{why}; got {value}")
    return value


def _choice(path: str, value: object, choices: tuple[str, ...]) -> None:
    if type(value) is not str or value not in choices:
        raise ManifestError(path, f"must be one of {', '.join(map(repr, choices))}; got {value!r}")


def _check(m: Manifest) -> None:
    if type(m.version) is not int or m.version != VERSION:
        raise ManifestError(
            "$.version", f"this runtime reads manifest version {VERSION}, not {m.version!r} (re-export the manifest)"
        )
    _choice("$.layout", m.layout, LAYOUTS)
    if m.model is not UNSET and (
        type(m.model) is not str or not 0 < len(m.model) <= MAX_MODEL_NAME or not m.model.isprintable()
    ):
        raise ManifestError("$.model", f"must be a printable name of 1 to {MAX_MODEL_NAME} characters; got {m.model!r}")
    _int("$.num_layers", m.num_layers, 1, MAX_LAYERS)
    _int("$.kv_heads", m.kv_heads, 1, MAX_KV_HEADS)
    _int("$.head_dim", m.head_dim, 1, MAX_HEAD_DIM)
    _choice("$.dtype", m.dtype, tuple(DTYPE_BYTES))
    if m.kv_dtype is not UNSET:
        _choice("$.kv_dtype", m.kv_dtype, tuple(KV_DTYPE_BYTES))
    capacity = _int("$.maximum_capacity", m.maximum_capacity, 1, MAX_CAPACITY, " positions per sequence")
    why = " (maximum_capacity: one step cannot write more than a sequence holds)"
    _int("$.max_write", m.max_write, 1, capacity, why)
    _check_layout_fields(m)
    _int("$.max_sample_rows", m.max_sample_rows, 1, MAX_SAMPLE_ROWS, " logits rows per step")
    _check_widths(m)
    by_id = _check_layers(m)
    total = _kv_bytes(m, by_id)
    if total > MAX_KV_BYTES:
        raise ManifestError(
            "$.maximum_capacity",
            f"K/V at full capacity would take {total} bytes ({total / 2**40:.2f} TiB); the bound is "
            f"{MAX_KV_BYTES} bytes (1 TiB): lower maximum_capacity, max_seqs or max_cells",
        )


def _check_layout_fields(m: Manifest) -> None:
    for name, owner in LAYOUT_FIELDS.items():
        if getattr(m, name) is not UNSET and m.layout != owner:
            raise ManifestError(
                f"$.{name}", f"only layout {owner!r} takes {name}; this manifest's layout is {m.layout!r} (remove it)"
            )
    if m.layout == "batched-sequence":
        if m.max_seqs is UNSET:
            raise ManifestError("$.max_seqs", "layout 'batched-sequence' needs max_seqs (resident sequences, >= 1)")
        seqs = _int("$.max_seqs", m.max_seqs, 1, MAX_SEQS, " sequences")
        if m.max_segments is not UNSET:
            _int("$.max_segments", m.max_segments, seqs, MAX_SEGMENTS, " (max_seqs: every sequence needs a run)")
        if m.causal is not UNSET and type(m.causal) is not bool:
            raise ManifestError("$.causal", f"expected true or false, got {m.causal!r}")
        limit = MAX_STEP_TOKENS // seqs
        _int("$.max_write", m.max_write, 1, limit, f" (max_seqs * max_write may be at most {MAX_STEP_TOKENS} tokens)")
    if m.layout == "cell":
        if m.max_cells is UNSET:
            raise ManifestError("$.max_cells", "layout 'cell' needs max_cells (cells in the shared pool, >= max_write)")
        _int("$.max_cells", m.max_cells, m.max_write, MAX_CELLS, " (max_write: one step's tokens must fit)")
    if m.max_write > MAX_STEP_TOKENS:
        raise ManifestError("$.max_write", f"must be at most {MAX_STEP_TOKENS} tokens per step; got {m.max_write}")


def _check_widths(m: Manifest) -> None:
    widths = m.step_widths
    if type(widths) is not tuple:
        raise ManifestError("$.step_widths", f"expected a tuple of integers, got {type(widths).__name__}")
    if len(widths) > MAX_WIDTHS:
        raise ManifestError("$.step_widths", f"at most {MAX_WIDTHS} captured widths; got {len(widths)}")
    limit = m.step_tokens
    for i, width in enumerate(widths):
        _int(f"$.step_widths[{i}]", width, 1, limit, " (tokens one step may write: max_write per sequence)")
        if i and width <= widths[i - 1]:
            raise ManifestError(
                f"$.step_widths[{i}]", f"widths must be strictly increasing; {width} follows {widths[i - 1]}"
            )


def _check_layers(m: Manifest) -> dict[int, Layer]:
    layers = m.layers
    if type(layers) is not tuple:
        raise ManifestError("$.layers", f"expected a tuple of Layer, got {type(layers).__name__}")
    if len(layers) != m.num_layers:
        raise ManifestError("$.layers", f"has {len(layers)} entries; num_layers is {m.num_layers} (one per layer)")
    by_id: dict[int, Layer] = {}
    first: dict[int, int] = {}
    for i, entry in enumerate(layers):
        path = f"$.layers[{i}]"
        if not isinstance(entry, Layer):
            raise ManifestError(path, f"expected a Layer, got {type(entry).__name__}")
        layer_id = _int(f"{path}.layer_id", entry.layer_id, 0, m.num_layers - 1, " (ids cover 0..num_layers-1)")
        if layer_id in first:
            raise ManifestError(f"{path}.layer_id", f"{layer_id} is already used by $.layers[{first[layer_id]}]")
        first[layer_id] = i
        _choice(f"{path}.policy", entry.policy, POLICIES)
        window = _int(f"{path}.window", entry.window, 0, MAX_CAPACITY, " positions (0: no window)")
        if entry.policy == "ring" and window == 0:
            raise ManifestError(f"{path}.window", "a ring layer needs window > 0 (the ring holds that window)")
        by_id[layer_id] = entry
    return by_id  # n distinct ids in [0, n): they cover 0..n-1


_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def key_path(base: str, key: str) -> str:
    """JSON path of `key` under `base`: `$.name`, or `$["odd key"]` for names that need quoting."""
    if _IDENT.fullmatch(key):
        return f"{base}.{key}"
    return f"{base}[{json.dumps(key)}]"
