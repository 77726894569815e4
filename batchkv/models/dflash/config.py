"""`DFlashConfig`: a drafter's geometry, and its config.json (see `batchkv.models.dflash`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from batchkv.checks import int_arg, int_args
from batchkv.errors import CheckpointError, ConfigError


@dataclass(frozen=True)
class DFlashConfig:
    """Geometry of a drafter. hidden and vocab are the target's (its embedding and LM head are
    shared); target_layer_ids are the target layers whose outputs form the context features."""

    hidden: int
    num_layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    target_layer_ids: tuple[int, ...]
    block_size: int = 16
    mask_token_id: int = 0
    rms_eps: float = 1e-6
    rope_theta: float = 1e6
    extra: dict = field(default_factory=dict, compare=False)  # other config.json keys, kept on save

    def __post_init__(self) -> None:
        ids = int_args("DFlashConfig.target_layer_ids", self.target_layer_ids, 0)  # "1" or 1.5 are refused
        object.__setattr__(self, "target_layer_ids", ids)
        for name in ("hidden", "num_layers", "q_heads", "kv_heads", "head_dim", "intermediate", "vocab"):
            object.__setattr__(self, name, int_arg(f"DFlashConfig.{name}", getattr(self, name), 1))
        if self.q_heads % self.kv_heads or self.head_dim % 2:
            raise ConfigError(f"DFlashConfig: q_heads {self.q_heads} must be a multiple of kv_heads "
                              f"{self.kv_heads} and head_dim {self.head_dim} even")  # fmt: skip
        if not self.target_layer_ids or min(self.target_layer_ids) < 0:
            raise ConfigError(f"DFlashConfig.target_layer_ids {self.target_layer_ids}: give the tapped target layers")
        why = " (a block is an anchor and at least one mask)"
        object.__setattr__(self, "block_size", int_arg("DFlashConfig.block_size", self.block_size, 2, why=why))
        why = " (an id of the target's vocabulary)"
        mask = int_arg("DFlashConfig.mask_token_id", self.mask_token_id, 0, self.vocab - 1, why=why)
        object.__setattr__(self, "mask_token_id", mask)

    @property
    def features(self) -> int:
        """Width of one position's context features: len(target_layer_ids) * hidden."""
        return len(self.target_layer_ids) * self.hidden

    def to_json(self) -> dict:
        """config.json content (transformers-style names, `dflash_config` for the drafting fields)."""
        out = dict(self.extra)
        out.update(
            architectures=["DFlashDraftModel"], model_type="qwen3", hidden_size=self.hidden,
            num_hidden_layers=self.num_layers, num_attention_heads=self.q_heads,
            num_key_value_heads=self.kv_heads, head_dim=self.head_dim, intermediate_size=self.intermediate,
            vocab_size=self.vocab, rms_norm_eps=self.rms_eps, rope_theta=self.rope_theta, block_size=self.block_size,
            dflash_config={"target_layer_ids": list(self.target_layer_ids), "block_size": self.block_size,
                           "mask_token_id": self.mask_token_id},
        )  # fmt: skip
        return out

    @classmethod
    def from_json(cls, data: dict) -> DFlashConfig:
        """Read a config.json (block_size from `dflash_config`, else top level, else 16)."""
        try:
            dflash = data["dflash_config"]
            rope = data.get("rope_theta") or (data.get("rope_parameters") or {}).get("rope_theta") or 1e6
            fields = {
                "hidden": data["hidden_size"], "num_layers": data["num_hidden_layers"],
                "q_heads": data["num_attention_heads"], "kv_heads": data["num_key_value_heads"],
                "head_dim": data.get("head_dim") or data["hidden_size"] // data["num_attention_heads"],
                "intermediate": data["intermediate_size"], "vocab": data["vocab_size"],
                "target_layer_ids": tuple(dflash["target_layer_ids"]),
                "block_size": dflash.get("block_size", data.get("block_size", 16)),
                "mask_token_id": dflash["mask_token_id"], "rms_eps": data.get("rms_norm_eps", 1e-6),
                "rope_theta": float(rope),
            }  # fmt: skip
        except (KeyError, TypeError) as exc:
            raise CheckpointError(
                f"DFlash config.json lacks {exc} (needs dflash_config and the Qwen3 geometry)"
            ) from exc
        known = {"architectures", "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size", "rms_norm_eps", "rope_theta",
                 "block_size", "dflash_config"}  # fmt: skip
        return cls(**fields, extra={k: v for k, v in data.items() if k not in known})
