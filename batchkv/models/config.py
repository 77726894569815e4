"""SenseNova-U1 language-model geometry, and the model presets in one place.

`MODEL_PRESETS` holds whole models (geometry, dtype, random-init scales). KV geometry for the
cache follows from a model via `model.cache_spec()`; batchkv/presets.py (KV_PRESETS) derives the
KV geometry a manifest is exported with from these.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchkv.checks import int_arg
from batchkv.errors import ConfigError


@dataclass(frozen=True)
class SenseNovaConfig:
    """Geometry of the SenseNova-U1 language model (understanding path).

    num_layers, hidden, q_heads, kv_heads, head_dim, intermediate (SwiGLU width), vocab.
    rms_eps: every RMSNorm's epsilon. theta_t / theta_hw: RoPE bases of the t section (first
    head_dim/2 dims) and of the h and w sections (head_dim/4 dims each).
    dtype: default parameter dtype. init_gain / lm_head_gain: random init draws each projection
    with std `gain / sqrt(fan_in)`; a large `lm_head_gain` gives peaky, well-separated logits so
    greedy decoding does not flip between near-ties under different batching. norm_jitter: norm
    weights start at `1 + norm_jitter * N(0, 1)` so a swapped or skipped norm shows in tests.
    """

    num_layers: int
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    rms_eps: float = 1e-6
    theta_t: float = 5e6
    theta_hw: float = 1e4
    dtype: torch.dtype = torch.bfloat16
    init_gain: float = 1.0
    lm_head_gain: float = 1.0
    norm_jitter: float = 0.0

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden", "q_heads", "kv_heads", "head_dim", "intermediate", "vocab"):
            object.__setattr__(self, name, int_arg(f"SenseNovaConfig.{name}", getattr(self, name), 1))
        if self.q_heads % self.kv_heads:
            raise ConfigError(
                f"SenseNovaConfig: q_heads {self.q_heads} is not a multiple of kv_heads {self.kv_heads} (GQA groups)"
            )
        if self.head_dim % 8:
            raise ConfigError(
                f"SenseNovaConfig.head_dim is {self.head_dim}; 3-D RoPE rotates halves of head_dim/2 and "
                "head_dim/4 sections, so head_dim must be a multiple of 8"
            )

    @property
    def num_params(self) -> int:
        """Parameters of the model (embedding and LM head included)."""
        d, h = self.head_dim, self.hidden
        attn = h * (self.q_heads + 2 * self.kv_heads) * d + self.q_heads * d * h + 2 * d
        layer = attn + 3 * h * self.intermediate + 2 * h
        return self.num_layers * layer + 2 * self.vocab * h + h


MODEL_PRESETS: dict[str, SenseNovaConfig] = {
    # The published SenseNova-U1-8B language model (understanding path).
    "sensenova-u1-8b": SenseNovaConfig(
        num_layers=42,
        hidden=4096,
        q_heads=32,
        kv_heads=8,
        head_dim=128,
        intermediate=12288,
        vocab=151936,
        dtype=torch.bfloat16,
    ),
    # CPU-sized, same structure; peaky logits so greedy tokens are stable across batching.
    "sensenova-u1-tiny": SenseNovaConfig(
        num_layers=4,
        hidden=128,
        q_heads=4,
        kv_heads=2,
        head_dim=32,
        intermediate=256,
        vocab=512,
        dtype=torch.float32,
        lm_head_gain=8.0,
        norm_jitter=0.2,
    ),
}


def preset_config(name: str) -> SenseNovaConfig:
    """The config of a model preset; raises ConfigError naming the known presets."""
    if name not in MODEL_PRESETS:
        raise ConfigError(f"model preset {name!r} is unknown; use one of {sorted(MODEL_PRESETS)}")
    return MODEL_PRESETS[name]
