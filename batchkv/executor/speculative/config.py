"""`SpeculativeConfig`: which proposer drafts, and how long a block is."""

from __future__ import annotations

from dataclasses import dataclass

from batchkv.checks import int_arg
from batchkv.errors import ConfigError

METHODS = ("dflash", "ngram")
MAX_BLOCK_SIZE = 32  # verify rows per sample per step; with 64 anchors at most 2048 logits rows a step
# Sampling rows (verify segments) of one speculating step: each brings up to block_size - 1 drafts,
# so the step widths reach max_step_tokens + min(MAX_SPECULATIVE_ROWS, max_seqs) * (block_size - 1).
MAX_SPECULATIVE_ROWS = 256


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding for an `Engine`.

    method: "ngram" (prompt lookup: the last 1..`ngram_max` tokens matched against the sequence's
        own prompt and output, proposing what followed) or "dflash" (a `DFlashDrafter` drafts a
        whole block in one non-causal forward over the target's hidden states).
    block_size: rows of one verify segment, `[anchor, d1 .. d(block_size - 1)]` (2..32). Each
        speculating sample proposes at most block_size - 1 drafts a step.
    drafter: the `batchkv.models.dflash.DFlashDrafter` for method "dflash" (its own block size is
        the default when block_size is None).
    ngram_max: the longest suffix the n-gram proposer matches (1..8).
    adaptive: each sample's draft count follows its acceptance (`policy.py`: halved toward what
        was accepted, doubled when all were, none while nothing is, with probes); False: always
        block_size - 1. Either way drafts stop short of capacity and max_new_tokens.

    >>> Engine(model, speculative=SpeculativeConfig("ngram", block_size=8))
    """

    method: str
    block_size: int | None = None
    drafter: object | None = None
    ngram_max: int = 3
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"SpeculativeConfig.method is {self.method!r}; use one of {METHODS}")
        if self.method == "dflash" and self.drafter is None:
            raise ConfigError("SpeculativeConfig(method='dflash') needs drafter= (see batchkv.models.dflash)")
        if self.method == "ngram" and self.drafter is not None:
            raise ConfigError("SpeculativeConfig(method='ngram') takes no drafter; use method='dflash'")
        block = self.block_size
        if block is None:
            block = getattr(getattr(self.drafter, "config", None), "block_size", 8)
        why = " (an anchor plus at least one draft; the bound caps a step's verify rows)"
        block = int_arg("SpeculativeConfig.block_size", block, 2, MAX_BLOCK_SIZE, why=why)
        object.__setattr__(self, "block_size", block)
        object.__setattr__(self, "ngram_max", int_arg("SpeculativeConfig.ngram_max", self.ngram_max, 1, 8))
        if not isinstance(self.adaptive, bool):
            raise ConfigError(f"SpeculativeConfig.adaptive is {self.adaptive!r}; use True or False")
