"""The speculator: where speculative decoding plugs into the engine's step.

Two fixed points of `Engine.step()`:
- `extend(batch)`, after planning and before the step is declared: every decode sample of the batch
  gets k drafts from the proposer, and its one-token decode row becomes a causal verify segment
  `[anchor, d1 .. dk]` whose every row is a logits row. k <= block_size - 1, as `DraftLengths`
  (`policy.py`) allows after the sample's past acceptance, shortened so the segment never writes
  past `capacity` and the sample never passes `max_new_tokens`; k = 0 leaves the decode row as is. Prompt chunks
  and prompts' last rows stay as they are (segments with k = 0).
- `accept(batch, runs)`, after the step committed and the host read the accepted runs: every
  verify segment's column is rewound to its accepted end (anchor + accepted drafts); the bonus
  token becomes the next anchor. The rejected drafts were written, so the cache's high-water ring
  floor bounds the rewind and its `max_write` is at least `block_size`.

`NoSpeculation` has the same surface and does nothing, so the step has no branch for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from batchkv.cache import BatchedSequenceCache
from batchkv.executor.metrics import Metrics
from batchkv.executor.scheduler import SampleState, StepPlan
from batchkv.executor.speculative.config import SpeculativeConfig
from batchkv.executor.speculative.ngram import ngram_propose
from batchkv.executor.speculative.policy import DraftLengths


class NoSpeculation:
    """The engine's speculator when speculation is off: both fixed points do nothing."""

    def extend(self, batch: StepPlan) -> None:
        """Leave the batch as planned."""

    def accept(self, batch: StepPlan, runs: list[list[int]]) -> None:
        """Nothing to rewind."""

    def release(self) -> None:
        """Nothing held."""

    def sequences(self) -> list[int]:
        """Columns held in caches other than the engine's (none)."""
        return []


@dataclass
class Drafts:
    """A step's drafts, per decode sample. `tokens` are the ids (placeholders when the drafts stay
    on the device); `src`, when set, indexes each draft in the proposer's device draft buffer."""

    tokens: list[list[int]]
    src: list[list[int]] | None = None


class Proposer(Protocol):
    """Drafts for the decode samples of a step (host planning, before the step is declared)."""

    def propose(self, batch: StepPlan, samples: list[SampleState], counts: list[int]) -> Drafts:
        """At most counts[i] drafts for samples[i]."""
        ...

    def observe(self, batch: StepPlan, runs: list[list[int]]) -> None:
        """The step committed with these accepted runs (before the target's columns are rewound)."""
        ...

    def release(self) -> None:
        """Free whatever is held for samples that finished or were cancelled."""
        ...

    def sequences(self) -> list[int]:
        """Columns the proposer holds in its own cache."""
        ...


class NgramProposer:
    """Prompt lookup over each sample's own history (see `ngram.py`). Holds nothing."""

    def __init__(self, ngram_max: int) -> None:
        self.ngram_max = ngram_max

    def propose(self, batch: StepPlan, samples: list[SampleState], counts: list[int]) -> Drafts:
        out = []
        for sample, count in zip(samples, counts, strict=True):
            if count <= 0:
                out.append([])
                continue
            history = np.fromiter((*sample.owner.prompt, *sample.tokens), dtype=np.int64)
            out.append(ngram_propose(history, count, self.ngram_max))
        return Drafts(out)

    def observe(self, batch: StepPlan, runs: list[list[int]]) -> None:
        return None

    def release(self) -> None:
        return None

    def sequences(self) -> list[int]:
        return []


class Speculator:
    """Drafts, verify segments and rewinds over the engine's cache (see the module docstring)."""

    def __init__(
        self, config: SpeculativeConfig, cache: BatchedSequenceCache, proposer: Proposer, metrics: Metrics
    ) -> None:
        self.config, self.cache, self.proposer, self.metrics = config, cache, proposer, metrics
        self.block_size = config.block_size
        self.lengths = DraftLengths(config.block_size - 1, fixed=not config.adaptive)  # type: ignore[operator]
        self.runner: object = None  # the engine's VerifyRunner (set by build_speculator)

    def draft_len(self, sample: SampleState) -> int:
        """Drafts a decode sample may take this step (called once per step): what its draft length
        allows, with its verify segment inside capacity and its accepted run (drafts + bonus)
        inside max_new_tokens."""
        emitted, prompt = len(sample.tokens), len(sample.owner.prompt)
        room = self.cache.capacity - prompt - emitted  # the anchor sits at prompt + emitted - 1
        left = sample.owner.request.params.max_new_tokens - emitted - 1
        return max(0, min(self.lengths.next(sample), room, left))

    def extend(self, batch: StepPlan) -> None:
        """Turn each decode row of `batch` into a verify segment (host planning)."""
        decode = batch.decode_tokens  # decode rows come first, one per sample, row i for sample i
        samples = batch.samples[:decode]
        counts = [self.draft_len(s) for s in samples]
        drafts = self.proposer.propose(batch, samples, counts)
        seq_ids, input_ids, t_index, draft_src, rows, spans = [], [], [], [], [], []
        for i, (sample, extra) in enumerate(zip(samples, drafts.tokens, strict=True)):
            k = len(extra)
            start = len(seq_ids)
            seq_ids += [sample.seq] * (k + 1)
            input_ids += [batch.input_ids[i], *extra]
            t_index += range(batch.t_index[i], batch.t_index[i] + k + 1)
            draft_src += [-1, *(drafts.src[i] if drafts.src is not None else [-1] * k)]
            rows += range(start, start + k + 1)
            spans.append(k + 1)
        shift = len(seq_ids) - decode
        batch.seq_ids = seq_ids + batch.seq_ids[decode:]
        batch.input_ids = input_ids + batch.input_ids[decode:]
        batch.t_index = t_index + batch.t_index[decode:]
        batch.draft_src = draft_src + [-1] * (len(batch.seq_ids) - len(seq_ids)) if drafts.src is not None else []
        batch.rows = rows + [row + shift for row in batch.rows[decode:]]
        batch.spans = spans + batch.spans[decode:]
        batch.decode_tokens += shift

    def accept(self, batch: StepPlan, runs: list[list[int]]) -> None:
        """Rewind every verify segment's column to its accepted end; count proposals and acceptances."""
        self.proposer.observe(batch, runs)
        m = self.metrics
        for sample, span, run in zip(batch.samples, batch.spans, runs, strict=True):
            if span == 1:
                continue
            rejected = span - len(run)  # the bonus replaces the first rejected draft's row
            if rejected:
                self.cache.rewind(sample.seq, self.cache.pos(sample.seq) - rejected)
            self.lengths.update(sample, span - 1, len(run) - 1)
            m.spec_segments += 1
            m.spec_proposed += span - 1
            m.spec_accepted += len(run) - 1

    def release(self) -> None:
        """Free the proposer's columns of finished and cancelled samples, and their draft lengths."""
        self.proposer.release()
        self.lengths.release()

    def sequences(self) -> list[int]:
        return self.proposer.sequences()
