"""From a manifest to a cache, and from export options to a manifest.

`from_manifest` builds the cache kind the layout names: `batched-sequence` is a
`BatchedSequenceCache` of `max_seqs` columns, `sequence` the same store with one column. `cell` (a
shared pool of cells, llama.cpp style) is not built: the column store serves every case the cell
pool served, so such a manifest is refused with the layout to export instead.

`make_manifest` turns the export options (a preset or explicit geometry, a layout, a window
pattern) into a validated `Manifest`; `batchkv export` is a thin shell around it.
"""

from __future__ import annotations

import os

import torch

from batchkv.cache import BatchedSequenceCache, CacheConfig, LayerSpec
from batchkv.checks import int_arg
from batchkv.dtypes import dtype_named
from batchkv.errors import ConfigError, UnsupportedLayout
from batchkv.manifest.codec import load_manifest
from batchkv.manifest.pair import CachePair, ManifestPair, decode_pair, is_pair, read_source
from batchkv.manifest.schema import MAX_LAYERS, Layer, Manifest

OVERRIDES = (
    "capacity",
    "max_seqs",
    "max_write",
    "max_segments",
    "max_width",
    "buckets",
    "tail_step",
    "pool_rows",
    "dtype",
    "kv_dtype",
)
DEFAULT_MAX_WRITE = 512  # a prefill chunk per sequence per step


def cache_config(manifest: Manifest, **overrides: object) -> CacheConfig:
    """The `CacheConfig` a manifest describes; `overrides` replace `CacheConfig` fields.

    Overrides (`capacity`, `max_seqs`, `max_write`, `max_segments`, `max_width`, `buckets`,
    `tail_step`, `pool_rows`, `dtype`, `kv_dtype`; dtypes as torch dtypes or manifest names) serve
    tests and small machines: the same layer pattern at a smaller scale (`pool_rows`: a store
    allocated whole, e.g. the manifest's `pool_rows(0)` for every sequence at capacity). Lowering `max_seqs` without
    `max_segments` resets it to its default `2 * max_seqs`.
    """
    if manifest.layout == "cell":
        raise UnsupportedLayout(
            "layout 'cell' (a shared pool of cells) is not built by this runtime; the column store serves "
            "every case the cell pool served: re-export with `batchkv export --kv-layout batched-sequence`"
        )
    unknown = sorted(set(overrides) - set(OVERRIDES))
    if unknown:
        raise ConfigError(f"from_manifest: unknown override(s) {unknown}; use any of {list(OVERRIDES)}")
    if manifest.layout == "sequence" and overrides.get("max_seqs", 1) != 1:
        raise ConfigError(
            f"a 'sequence' manifest holds one sequence; max_seqs={overrides['max_seqs']} needs a "
            "'batched-sequence' manifest (batchkv export --kv-layout batched-sequence --max-kv-seqs N)"
        )
    fields: dict[str, object] = {
        "num_layers": manifest.num_layers,
        "kv_heads": manifest.kv_heads,
        "head_dim": manifest.head_dim,
        "max_seqs": manifest.sequences,
        "capacity": manifest.maximum_capacity,
        "max_write": manifest.max_write,
        "layers": tuple(LayerSpec(e.policy, e.window) for e in sorted(manifest.layers, key=lambda e: e.layer_id)),
        "dtype": dtype_named(manifest.dtype),
        "kv_dtype": dtype_named(manifest.storage_dtype),
        "max_segments": manifest.segments,
    }
    if "max_seqs" in overrides and "max_segments" not in overrides:
        fields["max_segments"] = 0  # CacheConfig's default: 2 * max_seqs
    for name in ("dtype", "kv_dtype"):
        if isinstance(overrides.get(name), str):
            overrides[name] = dtype_named(overrides[name])  # type: ignore[arg-type]
    fields.update(overrides)
    return CacheConfig(**fields)  # type: ignore[arg-type]


def from_manifest(
    source: Manifest | str | os.PathLike[str] | bytes,
    device: torch.device | str = "cpu",
    *,
    attention: str = "auto",
    **overrides: object,
) -> BatchedSequenceCache:
    """Build the cache a manifest (a `Manifest`, a file path, or the file's bytes) describes.

    Storage starts small and grows as sequences are placed and lengthen, each holding what it can
    reach, up to every sequence at `maximum_capacity` (see `BatchedSequenceCache.reserve`; pass
    `pool_rows=manifest.pool_rows(0)` to allocate that whole at once). The manifest's `causal` is
    not a cache setting: whoever drives the model passes `manifest.is_causal` to
    `update_and_attend` (the cache takes it per call).

    Example:
        cache = from_manifest("manifests/sensenova-u1-8b-batched-16.json", "cuda")
        cache.max_seqs, cache.capacity          # (16, 32768)
        tiny = from_manifest("manifests/sensenova-u1-8b-batched-16.json", max_seqs=2, capacity=64)

    A DFlash pair manifest (`batchkv.manifest.pair`) builds both caches and returns a
    `CachePair(target, drafter)`.

    Raises `ManifestError` for an invalid file, `UnsupportedLayout` for `cell`, `ConfigError` for
    a bad override.
    """
    if isinstance(source, ManifestPair) or (not isinstance(source, Manifest) and is_pair(read_source(source))):
        pair = source if isinstance(source, ManifestPair) else decode_pair(read_source(source))
        drafter_overrides = dict(overrides)
        if "max_write" in overrides:  # the drafter writes context rows plus a block
            drafter_overrides["max_write"] = overrides["max_write"] + pair.block_size  # type: ignore[operator]
        return CachePair(  # type: ignore[return-value]
            BatchedSequenceCache(cache_config(pair.target, **overrides), device, attention=attention),
            BatchedSequenceCache(cache_config(pair.drafter, **drafter_overrides), device, attention=attention),
        )
    manifest = source if isinstance(source, Manifest) else load_manifest(source)
    return BatchedSequenceCache(cache_config(manifest, **overrides), device, attention=attention)


def window_pattern(num_layers: int, every: int = 0, window: int = 0) -> tuple[Layer, ...]:
    """Layers where every `every`-th one (layer ids every-1, 2*every-1, ...) is a ring of `window`
    positions and the rest are flat; `every=0` makes all layers flat."""
    num_layers = int_arg("num_layers", num_layers, 1)
    every, window = int_arg("window_every", every), int_arg("window", window)
    if every < 0 or (every > 0) != (window > 0):
        raise ConfigError(
            f"window_every={every} and window={window}: give both (every K-th layer becomes a ring of "
            "window W) or neither"
        )
    if every > num_layers:
        raise ConfigError(f"window_every={every} is more than the {num_layers} layers: no layer would be a ring")
    ring = [every > 0 and (i + 1) % every == 0 for i in range(num_layers)]
    return tuple(Layer(i, "ring", window) if ring[i] else Layer(i, "flat", 0) for i in range(num_layers))


def default_widths(sequences: int) -> tuple[int, ...]:
    """Decode widths to capture: powers of two below `sequences`, then `sequences` itself."""
    widths = [1 << k for k in range(sequences.bit_length()) if 1 << k < sequences]
    return (*widths, sequences)


def make_manifest(
    *,
    layout: str,
    num_layers: int,
    kv_heads: int,
    head_dim: int,
    dtype: str,
    capacity: int,
    kv_dtype: str | None = None,
    max_seqs: int = 1,
    max_write: int | None = None,
    max_segments: int | None = None,
    causal: bool | None = None,
    max_cells: int | None = None,
    window_every: int = 0,
    window: int = 0,
    step_widths: tuple[int, ...] | None = None,
    max_sample_rows: int = 64,
    model: str | None = None,
) -> Manifest:
    """A validated manifest from export options (the arguments of `batchkv export`).

    `kv_dtype` (storage; e.g. "float8_e4m3fn") is recorded only when given (default `dtype`).
    `max_write` defaults to min(512, capacity); `max_segments` to 2 * max_seqs and `causal` to true
    (batched-sequence); `max_cells` (cell) to max_seqs * capacity; `step_widths` to the decode
    widths 1, 2, 4, ... max_seqs. Options the layout does not take are refused.
    """
    if layout == "sequence" and max_seqs != 1:
        raise ConfigError(
            f"layout 'sequence' holds one sequence; for max_seqs={max_seqs} use --kv-layout batched-sequence"
        )
    given = {"max_segments": max_segments, "causal": causal, "max_cells": max_cells}
    takes = {"batched-sequence": ("max_segments", "causal"), "cell": ("max_cells",)}.get(layout, ())
    stray = [name for name, value in given.items() if value is not None and name not in takes]
    if stray:
        raise ConfigError(f"layout {layout!r} does not take {', '.join(stray)}")
    extra: dict[str, object] = {}
    if model is not None:
        extra["model"] = model
    if kv_dtype is not None:
        extra["kv_dtype"] = kv_dtype
    if layout == "batched-sequence":
        causal = True if causal is None else causal
        extra.update(max_seqs=max_seqs, max_segments=max_segments or 2 * max_seqs, causal=causal)
    elif layout == "cell":
        extra["max_cells"] = max_cells if max_cells is not None else max_seqs * capacity
    # An out-of-bounds layer count is refused by Manifest before it looks at the layers.
    layers = window_pattern(num_layers, window_every, window) if 0 < num_layers <= MAX_LAYERS else ()
    return Manifest(
        version=1,
        layout=layout,  # type: ignore[arg-type]
        num_layers=num_layers,
        kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=dtype,  # type: ignore[arg-type]
        maximum_capacity=capacity,
        max_write=max_write if max_write is not None else min(DEFAULT_MAX_WRITE, capacity),
        max_sample_rows=max_sample_rows,
        step_widths=tuple(step_widths) if step_widths is not None else default_widths(max_seqs),
        layers=layers,
        **extra,  # type: ignore[arg-type]
    )
