"""KV geometry of known models: what a manifest needs to size the cache, nothing more.

Model configs (hidden size, RoPE, MLP) live with the model code; a preset here carries only the
numbers that decide K/V storage. `KV_PRESETS` maps each preset's name to it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVPreset:
    """K/V storage geometry of one model: per layer K and V are [tokens, kv_heads, head_dim] of dtype."""

    name: str
    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: str  # a manifest dtype name: "bfloat16" | "float16" | "float32"


KV_PRESETS: dict[str, KVPreset] = {
    preset.name: preset
    for preset in (
        # SenseNova-U1-8B language model: 42 layers, 32 query / 8 KV heads of 128, bf16 (168 KiB per token).
        KVPreset("sensenova-u1-8b", num_layers=42, kv_heads=8, head_dim=128, dtype="bfloat16"),
        # The CPU-sized model the tests and demos run: same shape family, small enough for seconds on CPU.
        KVPreset("sensenova-u1-tiny", num_layers=4, kv_heads=2, head_dim=32, dtype="float32"),
    )
}
