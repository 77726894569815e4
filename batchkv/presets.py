"""KV geometry of known models: what a manifest needs to size the cache, nothing more.

Derived from the model presets (`batchkv.models.config.MODEL_PRESETS`), so the geometry a manifest
is exported with is the geometry the served model has. `KV_PRESETS` maps each preset's name to it.
"""

from __future__ import annotations

from dataclasses import dataclass

from batchkv.dtypes import dtype_name
from batchkv.models.config import MODEL_PRESETS


@dataclass(frozen=True)
class KVPreset:
    """K/V storage geometry of one model: per layer K and V are [tokens, kv_heads, head_dim] of dtype."""

    name: str
    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: str  # a manifest dtype name: "bfloat16" | "float16" | "float32"


KV_PRESETS: dict[str, KVPreset] = {
    name: KVPreset(name, cfg.num_layers, cfg.kv_heads, cfg.head_dim, dtype_name(cfg.dtype))
    for name, cfg in MODEL_PRESETS.items()
}
