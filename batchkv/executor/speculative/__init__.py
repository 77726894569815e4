"""Speculative decoding in the engine: proposers, verify segments, acceptance on the device.

- `SpeculativeConfig` picks the proposer: n-gram prompt lookup (`ngram.py`) or a DFlash drafter
  (`dflash.py`, over `batchkv.models.dflash.DFlashDrafter`).
- `Speculator` (`speculator.py`) plugs in at two fixed points of `Engine.step()`: it extends the
  planned batch with drafts before the step is declared, and rewinds after commit.
- `VerifyRunner` (`verify.py`) runs the step: one causal segment `[anchor, d1 .. dk]` per speculating
  sample beside other sequences' prompt chunks, every row a logits row, acceptance on the device
  (`acceptance.py`: greedy prefix match, or rejection sampling), one host read.

Greedy output equals non-speculative greedy output token for token; sampling keeps the
distribution (drafts are point-mass proposals; see `acceptance.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from batchkv.cache import BatchedSequenceCache
from batchkv.errors import ConfigError
from batchkv.executor.graphs import GraphSet
from batchkv.executor.speculative.config import MAX_BLOCK_SIZE, SpeculativeConfig
from batchkv.executor.speculative.speculator import NgramProposer, NoSpeculation, Proposer, Speculator
from batchkv.executor.speculative.verify import VerifyRunner

if TYPE_CHECKING:
    from batchkv.executor.metrics import Metrics
    from batchkv.executor.request import StepModel
    from batchkv.executor.roles import Role


def build_speculator(
    config: SpeculativeConfig,
    model: StepModel,
    graphs: GraphSet | None,
    *,
    cache: BatchedSequenceCache,
    metrics: Metrics,
    buckets: Sequence[int],
    prefill_chunk: int,
    role: Role,
) -> Speculator:
    """The speculator an engine with `config` runs: its proposer and its `VerifyRunner` (`.runner`).
    Handed what it uses of the engine: the cache, metrics, width buckets, prompt chunk and role."""
    missing = [name for name in ("hidden_states", "head") if not callable(getattr(model, name, None))]
    if missing:
        raise ConfigError(
            f"speculative decoding needs the model's {' and '.join(missing)} (final hidden states of chosen "
            f"rows, and the LM head); {type(model).__name__} lacks them"
        )
    proposer: Proposer
    drafts = taps = None
    if config.method == "ngram":
        proposer = NgramProposer(config.ngram_max)
    else:
        from batchkv.executor.speculative.dflash import DFlashProposer

        proposer = DFlashProposer(config, model, graphs, cache=cache, buckets=buckets, prefill_chunk=prefill_chunk,
                                  role=role)  # fmt: skip
        drafts, taps = proposer.drafts, proposer.taps
    speculator = Speculator(config, cache, proposer, metrics)
    runner = VerifyRunner(model, cache, buckets, config.block_size, graphs=graphs, drafts=drafts, taps=taps, role=role)  # type: ignore[arg-type]
    speculator.runner = runner
    return speculator


__all__ = [
    "MAX_BLOCK_SIZE",
    "NoSpeculation",
    "SpeculativeConfig",
    "Speculator",
    "VerifyRunner",
    "build_speculator",
]
