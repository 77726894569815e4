"""Overlap of host planning with the device: the engine keeps one launched step in flight.

`Engine.step()` launches a step (plan, declare, prepare, queue the forward and its sampling with
`ModelRunner.launch`, commit, `Scheduler.launched`) and then finishes one: it reads that step's
sampled tokens (the wait for the device), accepts drafts, and records tokens and finishes
(`Scheduler.complete`). `Pipeline` says which step is finished: with overlap the one launched by the
previous call, so the device runs step N while the host plans and queues N+1; without, the one just
launched. Everything else is the same code, so both modes emit the same tokens.

Why overlap changes no token:
- Inputs. A decode row whose newest token is still pending gathers it on the device from the
  previous launch's sampled tokens (`StepPlan.token_src`). Everything else a plan needs is known at
  launch: prompt progress, each sample's output index (`SampleState.count`: the sampling draw and
  the RoPE t), forks.
- Finishes known in advance (max_new_tokens, capacity) are never scheduled past: the sample leaves
  the running set, and its column is freed, when the step sampling its last token is launched.
- A stop id is seen one step late, when its token is read: the sample was already queued in the
  step in flight. That step's token for it is discarded and its column freed; the K/V the step wrote
  there is never read (a later owner of the column writes each position before attending to it).
- Cancelling frees the columns at once; tokens that launched steps sampled for a cancelled sample
  are discarded, so nothing follows its "cancelled" event.
- Forks (n > 1) clone the prompt's column when the step with the prompt's last chunk is launched
  (a device copy queued after that chunk's K/V writes); every sample's first token is sampled from
  that step's logits, so forks decode in the very next step with their ids gathered on the device.
- A launch that raises (the forward failing on the host) commits nothing: the previous launch stays
  in flight and the next `step()` plans again. Launches alternate between two token slots, so the
  failed attempt never overwrote the tokens the retry gathers.
- Storage growth (at admission, or in `prepare_step`) is stream-ordered: the copy into the new
  storage is queued after the step in flight, and the old storage goes back to the caching
  allocator on the same stream, which hands it only to later work. Graphs of the old generation are
  dropped while one may still be running; CUDA frees an executable graph once its launch completes.
- Speculative decoding plans each step from the accepted counts of the last one, which live on the
  device until read; a speculating engine therefore runs without overlap.

Host synchronisations left on the step path: `SampledTokens.read()` (waits for the step being
finished; with overlap the next step is queued behind it, so the device stays busy); the staging
buffers' wait for their previous copy (queued right after the step the host read last, so already
done); graph capture (synchronises the device once per width bucket, storage generation and module
tree); and storage growth, whose allocation may synchronise when the allocator must release cached
blocks (at admission, rarely).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from batchkv.errors import ConfigError
from batchkv.executor.logprobs import StepLogprobs
from batchkv.executor.scheduler import StepPlan


class StepTokens(Protocol):
    """What a runner's `launch` returns: the step's tokens on their way to the host."""

    slot: int

    def read(self) -> Sequence[list[int]]:
        """Per sampling row (or verify segment), the tokens it emitted; waits for the device."""
        ...

    def logprobs(self) -> tuple[list, list] | None:
        """After `read`: the step's logprobs (per sampling row, per prompt scoring row), or None
        when no row asked (see `batchkv.executor.logprobs`)."""
        ...


@dataclass
class InFlight:
    """A launched, committed step whose tokens the host has not read yet."""

    batch: StepPlan
    tokens: StepTokens
    width: int
    held: int  # columns held when it was planned (occupancy)


class Pipeline:
    """Which launched step `Engine.step()` finishes: the previous one (overlap) or its own."""

    def __init__(self, overlap: bool) -> None:
        self.overlap = overlap
        self.in_flight: InFlight | None = None

    @classmethod
    def for_engine(cls, overlap: bool | str, *, speculating: bool, device: torch.device) -> Pipeline:
        """`Engine(overlap=...)`: "auto" overlaps on CUDA unless speculating (CPU ops are synchronous:
        there overlap would only hand each token out a step later); True with speculation is refused."""
        if not isinstance(overlap, bool) and overlap != "auto":  # 1 or 0.0 would pass an `in` test
            raise ConfigError(f"overlap is {overlap!r}; use 'auto', True or False")
        if overlap is True and speculating:
            raise ConfigError(
                "overlap=True with speculative decoding: a speculating engine plans each step from the "
                "accepted counts of the last one, so it cannot queue a step ahead; use overlap='auto' or False"
            )
        return cls(overlap is True or (overlap == "auto" and device.type == "cuda" and not speculating))

    def swap(self, launched: InFlight | None) -> InFlight | None:
        """Hand in this call's launch (None if nothing was planned); get back the step to finish."""
        if not self.overlap:
            return launched
        done, self.in_flight = self.in_flight, launched
        return done


class SampledTokens:
    """A launched step's sampled tokens on their way to the host: a pinned slot and the event
    recorded after the copy into it (None on the CPU, where the copy has already happened), and
    the step's logprobs when some row asked (copied before the event)."""

    def __init__(
        self, host: torch.Tensor, slot: int, event: torch.cuda.Event | None, logprobs: StepLogprobs | None = None
    ) -> None:
        self.host, self.slot, self.event, self._logprobs = host, slot, event, logprobs

    def read(self) -> OneEach:
        """Each sampling row's token as a one-token list (`OneEach`); waits for the step on CUDA."""
        if self.event is not None:
            self.event.synchronize()
        return OneEach(self.host.numpy().copy())  # a copy: the pinned slot is reused two launches on

    def logprobs(self) -> tuple[list, list] | None:
        """`StepLogprobs.read()` of the step, or None when no row asked; call after `read`."""
        return self._logprobs.read() if self._logprobs is not None else None


class OneEach(Sequence[list[int]]):
    """The runs of a step whose every sampling row emitted one token, kept as one array: `flat`
    int64 [rows]. As a sequence it is each row's one-token list (what a verify step's accepted
    runs look like), made only when asked, so a plain step's tokens cross to the scheduler
    (`Scheduler.complete` reads `flat`) without a Python list per row. Equal to a list of lists
    with the same tokens."""

    __slots__ = ("flat",)

    def __init__(self, flat: np.ndarray) -> None:
        self.flat = flat

    def __len__(self) -> int:
        return len(self.flat)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [[token] for token in self.flat[i].tolist()]
        return [int(self.flat[i])]

    def __iter__(self) -> Iterator[list[int]]:
        return iter([[token] for token in self.flat.tolist()])

    def __eq__(self, other: object) -> bool:
        if isinstance(other, OneEach):
            return bool(np.array_equal(self.flat, other.flat))
        return isinstance(other, Sequence) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return repr(list(self))
