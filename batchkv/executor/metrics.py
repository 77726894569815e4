"""Engine counters and latencies: what `batchkv run` prints and `--json` writes.

Times are host wall-clock seconds. A step's time is one `Engine.step()` call that launched a step:
planning and queueing it, and finishing a step (reading its tokens, bookkeeping). With overlap the
call finishes the previous step, so in steady state its time is the device's time per step (or the
host's, whichever is longer); without, it is the whole step end to end. A token's time is when the
host read it. Inter-token latency is the gap between two consecutive arrivals of one sample's
tokens: one token per step without speculation; under speculation one verify step's accepted run,
so it is reported per verify step (`itl_per` says which), never as the 0 ms between tokens that
arrived together. Time to
first token runs from submit to a request's first token, once per request (its n samples take their
first tokens from the same step: counting each would weigh a request by its n).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from batchkv.executor.pipeline import InFlight


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else 0.0


@dataclass
class Metrics:
    """Running totals of one engine. `summary()` gives the derived numbers as a flat dict."""

    max_seqs: int
    steps: int = 0
    prefill_tokens: int = 0  # prompt tokens written
    decode_tokens: int = 0  # generated tokens fed back
    padded_tokens: int = 0  # width - real tokens, summed over steps
    generated_tokens: int = 0  # tokens sampled (events with a token)
    submitted: int = 0
    refused: int = 0
    finished: Counter = field(default_factory=Counter)  # finish reason -> samples
    captures: int = 0
    replays: int = 0
    growths: int = 0  # storage reallocations (cache.generation moves) since the engine started
    widths: Counter = field(default_factory=Counter)  # width bucket -> steps
    step_times: list[float] = field(default_factory=list)
    inter_token: list[float] = field(default_factory=list)
    first_token: list[float] = field(default_factory=list)
    occupancy_sum: float = 0.0  # sum over steps of held columns / max_seqs
    spec_segments: int = 0  # verify segments that carried drafts
    spec_proposed: int = 0  # drafts verified
    spec_accepted: int = 0  # drafts the acceptance rule took (a stop id inside the run may cut what is emitted)
    prefix_admitted: int = 0  # requests admitted with the prefix cache on
    prefix_hits: int = 0  # of them, those that reused a cached or live prefix
    prefix_reused: int = 0  # prompt positions reused (not computed)
    prefix_evictions: int = 0  # cached histories freed for room
    first_start: float | None = None
    last_end: float = 0.0
    generation: int = 0  # the cache's storage generation last seen
    prefix_seen: tuple[int, int, int, int] = (0, 0, 0, 0)  # the prefix cache's `counts()` last seen

    def note_prefix(self, counts: tuple[int, int, int, int]) -> None:
        """Add what the prefix cache counted since its `counts()` were last seen."""
        if counts == self.prefix_seen:  # most steps: nothing admitted or evicted
            return
        admitted, hits, reused, evictions = (a - b for a, b in zip(counts, self.prefix_seen, strict=True))
        self.prefix_admitted += admitted
        self.prefix_hits += hits
        self.prefix_reused += reused
        self.prefix_evictions += evictions
        self.prefix_seen = counts

    def fresh(self) -> Metrics:
        """Empty totals for the same engine, counting from now: the storage generation and the
        prefix cache's counts are carried, so earlier growths and admissions are not counted again
        (assign it to `engine.metrics` after a warm-up)."""
        return Metrics(self.max_seqs, generation=self.generation, prefix_seen=self.prefix_seen)

    def note_generation(self, generation: int) -> None:
        """Count storage reallocations: the cache's generation moved to `generation`."""
        self.growths += generation - self.generation
        self.generation = generation

    def observe_call(self, start: float, end: float, launched: InFlight | None, cancelled: list, engine: Any) -> None:
        """One `Engine.step()` call from `start` to `end`: the step it launched (None: it only
        finished one, whose tokens extend the elapsed time), the cancellations it handed out, and
        the engine's storage generation, prefix cache counts and graph counters after it."""
        runner = engine.runner
        self.note_generation(engine.cache.generation)
        self.note_prefix(engine.scheduler.prefix.counts())
        self.finished["cancelled"] += len(cancelled)
        self.captures, self.replays = runner.captures, runner.replays
        if launched is None:
            if self.first_start is not None:
                self.last_end = end
            return
        batch = launched.batch
        self.record_step(start, end, width=launched.width, prefill=batch.prefill_tokens,
                         decode=batch.decode_tokens, held_columns=launched.held)  # fmt: skip

    def observe_finish(
        self, now: float, table: Any, slots: np.ndarray, read: np.ndarray, emit: np.ndarray, finishes: list[str]
    ) -> None:
        """A finished step, read at `now`: its sampling rows' slots of the scheduler's `SlotTable`,
        each one's tokens read and newest token time before the step (`read`, `emit`), and the
        finish reasons of the samples it finished (`Scheduler.finishes`). Array work over the rows:
        one inter-token gap per sample that got tokens after an earlier one, one time to first token
        per request (its sample 0's first)."""
        got = table.read[slots] - read
        arrived = got > 0
        self.generated_tokens += int(got.sum())
        fresh = read == 0
        later = arrived
        if fresh.any():  # some sample's first tokens (a steady step: none)
            first = arrived & fresh & (table.index[slots] == 0)
            if first.any():
                self.first_token += (now - table.submitted[slots][first]).tolist()
            later = arrived & ~fresh
        if later.any():
            before = emit[later]
            if before.min() == before.max():  # the common step: every row's last token came from one step
                self.inter_token += [now - before[0].item()] * len(before)  # (no float made per row)
            else:
                self.inter_token += (now - before).tolist()
        self.finished.update(finishes)

    def record_step(
        self, start: float, end: float, *, width: int, prefill: int, decode: int, held_columns: int
    ) -> None:
        """One forward of `width` packed rows of which `prefill + decode` were real tokens."""
        if self.first_start is None:
            self.first_start = start
        self.last_end = end
        self.steps += 1
        self.step_times.append(end - start)
        self.prefill_tokens += prefill
        self.decode_tokens += decode
        self.padded_tokens += width - prefill - decode
        self.widths[width] += 1
        self.occupancy_sum += held_columns / self.max_seqs

    def record_tokens(self, now: float, previous: float | None, submitted: float | None, count: int = 1) -> None:
        """`count` tokens of one sample arriving together (a verify segment's accepted run);
        `previous` is the sample's last token time (None before its first); `submitted` the request's
        submit time when this sample's first token counts as the request's (None: it does not). A run
        is one arrival: one inter-token gap (per verify step), not one per token."""
        if count <= 0:
            return
        self.generated_tokens += count
        if previous is None:
            if submitted is not None:
                self.first_token.append(now - submitted)
        else:
            self.inter_token.append(now - previous)

    @property
    def elapsed(self) -> float:
        return 0.0 if self.first_start is None else self.last_end - self.first_start

    def summary(self) -> dict[str, float | int | str | dict[str, int]]:
        """Derived metrics: throughput, latency percentiles (ms), occupancy, graph counters."""
        elapsed = self.elapsed
        steps = max(self.steps, 1)
        real = self.prefill_tokens + self.decode_tokens
        return {
            "steps": self.steps,
            "elapsed_s": elapsed,
            "requests_submitted": self.submitted,
            "requests_refused": self.refused,
            "generated_tokens": self.generated_tokens,
            "prefill_tokens": self.prefill_tokens,
            "decode_tokens": self.decode_tokens,
            "padded_tokens": self.padded_tokens,
            "prefill_fraction": self.prefill_tokens / real if real else 0.0,
            "tokens_per_s": self.generated_tokens / elapsed if elapsed else 0.0,
            "processed_tokens_per_s": real / elapsed if elapsed else 0.0,
            "step_ms_mean": 1e3 * sum(self.step_times) / steps,
            "step_ms_p50": 1e3 * _percentile(self.step_times, 50),
            "step_ms_p99": 1e3 * _percentile(self.step_times, 99),
            "itl_per": "verify step" if self.spec_segments else "token",  # what one inter-token gap spans
            "itl_ms_p50": 1e3 * _percentile(self.inter_token, 50),
            "itl_ms_p99": 1e3 * _percentile(self.inter_token, 99),
            "ttft_ms_p50": 1e3 * _percentile(self.first_token, 50),
            "ttft_ms_p99": 1e3 * _percentile(self.first_token, 99),
            "occupancy": self.occupancy_sum / steps,
            "captures": self.captures,
            "replays": self.replays,
            "growths": self.growths,
            "width_buckets_used": len(self.widths),
            "finished": dict(self.finished),
            "prefix_hit_rate": self.prefix_hits / self.prefix_admitted if self.prefix_admitted else 0.0,
            "prefix_reused_tokens": self.prefix_reused,
            "prefix_evictions": self.prefix_evictions,
            "spec_proposed": self.spec_proposed,
            "spec_accepted": self.spec_accepted,
            "spec_acceptance_rate": self.spec_accepted / self.spec_proposed if self.spec_proposed else 0.0,
            # Accepted drafts + the bonus per verify segment with drafts (tau; a stop id may emit fewer).
            "spec_accept_len_mean": (
                (self.spec_accepted + self.spec_segments) / self.spec_segments if self.spec_segments else 0.0
            ),
        }
