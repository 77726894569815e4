"""What the scheduler plans with: a request's state, its samples' states, and one planned step.

Host-only dataclasses. `SampleState.pending` counts tokens sampled by launched steps that the host
has not read yet (see `batchkv.executor.pipeline`); `count` includes them, so a plan never waits
for a read to know a sample's next output index, RoPE t or whether it may be fed again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from batchkv.executor.request import Logprobs, Request
from batchkv.executor.slots import DETACHED, Column, SlotTable


class SampleState:
    """One of a request's n samples: its column, its tokens so far, and those still on the device.

    Its step state lives in its slot of the scheduler's `SlotTable` (`batchkv.executor.slots`):
    `seq`, `pending` and `last_emit` read and write that row. A sample made on its own (no table)
    keeps them in its `detached` dict, as does a sample whose slot was freed.
    """

    seq = Column("seq")  # column; -1 until the prompt is written (sample 0) or forked (others), and once freed
    # Launched steps that sampled for it and were not read yet (0 or 1 at planning time); each
    # counts as one token. A verify step may emit more, known only once read: speculating engines
    # finish every step before planning the next, so they never plan with one pending.
    pending = Column("pending")
    last_emit = Column("emit", float)  # host time of the last token (inter-token latency)

    def __init__(self, owner: RequestState, index: int) -> None:
        self.owner, self.index = owner, index
        self.tokens: list[int] = []  # read by the host
        self.matcher: object = None  # constrained decoding: its xgrammar matcher, made when it first samples
        self._finish: str | None = None
        self.table: SlotTable | None = None  # set by `SlotTable.take`
        self.slot = -1
        self.detached: dict = dict(DETACHED)

    @property
    def finish(self) -> str | None:
        return self._finish

    @finish.setter
    def finish(self, reason: str | None) -> None:
        self._finish = reason
        if self.slot >= 0:
            self.table.done[self.slot] = reason is not None  # type: ignore[union-attr]

    def detach(self) -> None:
        """Its slot is being freed: keep its values in `detached`."""
        self.detached = self.table.row(self.slot)  # type: ignore[union-attr]
        self.slot = -1

    def __repr__(self) -> str:
        return f"SampleState(request={self.owner.id}, index={self.index}, seq={self.seq}, finish={self.finish!r})"

    @property
    def count(self) -> int:
        """Tokens sampled so far, read or pending: the output index of the next one."""
        return len(self.tokens) + self.pending

    @property
    def next_t(self) -> int:
        """RoPE t of the newest token, the one the next decode row feeds back."""
        return self.owner.request.rope_offset + len(self.owner.prompt) + self.count - 1

    def exhausted(self, capacity: int) -> bool:
        """True once its sampled tokens reach max_new_tokens, or the newest has no position left
        (capacity): no step may feed it again, whatever the pending tokens turn out to be."""
        return self.count >= self.owner.request.params.max_new_tokens or len(self.owner.prompt) + self.count > capacity


@dataclass(eq=False)
class RequestState:
    """A submitted request: prompt progress and its samples."""

    id: int
    request: Request
    seed: int
    submitted: float
    prefilled: int = 0  # prompt tokens written to the cache
    cached: int = 0  # of them, those reused from the prefix cache (not computed)
    spare: int = 0  # columns held back for forks
    samples: list[SampleState] = field(default_factory=list)
    # prompt_logprobs so far (entry 0 None: the first token has no prefix); handed out with the first token
    prompt_logprobs: list[Logprobs | None] = field(default_factory=lambda: [None])
    grammar: object = None  # constrained decoding: the compiled grammar of params.constraint

    @property
    def prompt(self) -> tuple[int, ...]:
        return self.request.prompt_ids  # type: ignore[return-value]

    @property
    def remaining(self) -> int:
        return len(self.prompt) - self.prefilled

    def live(self) -> list[SampleState]:
        return [s for s in self.samples if s.finish is None]

    def rows_for(self, chunk: int) -> int:
        """Logits rows a prompt chunk of `chunk` tokens takes: n when it is the prompt's last (its
        last row samples n tokens) and, with prompt_logprobs, one per other token (each scores the
        next prompt token)."""
        final = chunk == self.remaining
        scored = chunk - final if self.request.params.prompt_logprobs is not None else 0
        return scored + (self.request.params.n if final else 0)

    def fit(self, chunk: int, rows: int) -> int:
        """`chunk` cut to what `rows` logits rows take: the last prompt token waits for a step with
        its n rows; with prompt_logprobs a chunk that is not the last takes one row per token."""
        if self.rows_for(chunk) <= rows:
            return chunk
        if self.request.params.prompt_logprobs is None:
            return chunk - 1
        return min(chunk, self.remaining - 1, rows)


@dataclass
class StepPlan:
    """One planned step: per packed token its sequence, token id and RoPE t; the sampling rows."""

    seq_ids: list[int] = field(default_factory=list)
    input_ids: list[int] = field(default_factory=list)
    t_index: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)  # packed row whose logits each sample row reads
    samples: list[SampleState] = field(default_factory=list)  # who samples at each row (segment)
    # Per sampling row: its sample's slot in the scheduler's `SlotTable` (int64, as `samples`), and
    # that table (None for a step no scheduler planned: the runner then reads `samples` one by one).
    slots: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    table: SlotTable | None = None
    # Logits rows of each sample's segment, in `rows` order: 1 for plain decode and prompt rows,
    # 1 + drafts for a verify segment [anchor, d1 .. dk] (set by the speculator).
    spans: list[int] = field(default_factory=list)
    # Per packed row: index into the proposer's device draft buffer, or -1 for `input_ids` (empty: all -1).
    draft_src: list[int] = field(default_factory=list)
    # Per packed row: the sampling row of the launched step whose token this row feeds (its id is
    # gathered on the device; `input_ids` holds 0 there), or -1 for `input_ids` (empty: all -1).
    token_src: list[int] = field(default_factory=list)
    decode_tokens: int = 0
    prefill: list[tuple[RequestState, int]] = field(default_factory=list)  # prompt chunks written
    completed: list[RequestState] = field(default_factory=list)  # prompts finished this step
    # prompt_logprobs: packed rows whose logits score the next prompt token (after the sampling rows
    # in the logits selector), the token each scores, and how many of them each request's chunk has.
    score_rows: list[int] = field(default_factory=list)
    score_tokens: list[int] = field(default_factory=list)
    scores: list[tuple[RequestState, int]] = field(default_factory=list)
    # Per logits row (sampling rows, then score rows): how many alternatives its logprobs carry, -1
    # for none. Empty when no row asks: the step then computes no logprobs at all.
    logprob_k: list[int] = field(default_factory=list)
    # Int lists above that the scheduler made from arrays (a plan's decode rows), kept as the arrays:
    # name -> (that list, its int64 array). `ints` reads the array while the field still holds that
    # list at that length (a field reassigned or extended is converted again).
    arrays: dict[str, tuple[list[int], np.ndarray]] = field(default_factory=dict)

    def ints(self, name: str) -> np.ndarray:
        """The int list field `name` (seq_ids, input_ids, t_index, rows, token_src) as int64: the
        array it was made from when it is unchanged, else converted (`np.fromiter`)."""
        values = getattr(self, name)
        kept = self.arrays.get(name)
        if kept is not None and kept[0] is values and len(values) == len(kept[1]):
            return kept[1]
        return np.fromiter(values, dtype=np.int64, count=len(values))

    @property
    def prefill_tokens(self) -> int:
        return sum(chunk for _, chunk in self.prefill)

    @property
    def logits_rows(self) -> int:
        """Rows that go through the LM head: sampling rows, then prompt scoring rows."""
        return len(self.rows) + len(self.score_rows)

    def add(self, seq: int, tokens: list[int], t_index: list[int]) -> int:
        """Append one segment; returns the packed row of its last token."""
        self.seq_ids += [seq] * len(tokens)
        self.input_ids += tokens
        self.t_index += t_index
        return len(self.seq_ids) - 1
