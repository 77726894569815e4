"""KV geometry of known models: what a manifest needs to size the cache, nothing more.

Derived from the model presets (`batchkv.models.config.MODEL_PRESETS`), so the geometry a manifest
is exported with is the geometry the served model has. `KV_PRESETS` maps each preset's name to it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchkv.models.config import MODEL_PRESETS

_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


@dataclass(frozen=True)
class KVPreset:
    """K/V storage geometry of one model: per layer K and V are [tokens, kv_heads, head_dim] of dtype."""

    name: str
    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: str  # a manifest dtype name: "bfloat16" | "float16" | "float32"


KV_PRESETS: dict[str, KVPreset] = {
    name: KVPreset(name, cfg.num_layers, cfg.kv_heads, cfg.head_dim, _DTYPE_NAMES[cfg.dtype])
    for name, cfg in MODEL_PRESETS.items()
}
