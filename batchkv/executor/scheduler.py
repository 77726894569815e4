"""Host planning of continuous batching: admission, step packing, forks and finishes.

Pure bookkeeping over `BatchedSequenceCache`'s BatchControl verbs; no tensors. Each step packs, in
order: one decode token per running sample (round-robin when a step cannot take them all), then
chunks of admitted prompts (FIFO) within the token budget. A prompt may take several steps; the
step that writes its last token samples its first token(s), and a request with n > 1 then forks
with `seq_clone` into n sequences that decode independently.

Columns: admission takes one column per request and holds back n - 1 more for its forks, so a
fork can never find the store full. Storage is reserved at admission for the request's longest
possible history (prompt + max_new_tokens - 1), so growth happens when a request arrives, not in
the middle of its decode.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from batchkv.cache import BatchedSequenceCache
from batchkv.executor.request import MAX_SAMPLE_ROWS, Event, Request


@dataclass(eq=False)
class SampleState:
    """One of a request's n samples: its column, tokens so far, and the next RoPE t."""

    owner: RequestState
    index: int
    seq: int = -1  # column; -1 until the prompt is written (sample 0) or forked (others)
    tokens: list[int] = field(default_factory=list)
    next_t: int = 0  # RoPE t of the next token fed back
    finish: str | None = None
    last_emit: float = 0.0  # host time of the last token (inter-token latency)


@dataclass(eq=False)
class RequestState:
    """A submitted request: prompt progress and its samples."""

    id: int
    request: Request
    seed: int
    submitted: float
    prefilled: int = 0  # prompt tokens written to the cache
    spare: int = 0  # columns held back for forks
    samples: list[SampleState] = field(default_factory=list)

    @property
    def prompt(self) -> tuple[int, ...]:
        return self.request.prompt_ids  # type: ignore[return-value]

    @property
    def remaining(self) -> int:
        return len(self.prompt) - self.prefilled

    def live(self) -> list[SampleState]:
        return [s for s in self.samples if s.finish is None]


@dataclass
class Batch:
    """One planned step: per packed token its sequence, token id and RoPE t; the sampling rows."""

    seq_ids: list[int] = field(default_factory=list)
    input_ids: list[int] = field(default_factory=list)
    t_index: list[int] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)  # packed row whose logits each sample row reads
    samples: list[SampleState] = field(default_factory=list)  # who samples at each row (segment)
    # Logits rows of each sample's segment, in `rows` order: 1 for plain decode and prompt rows,
    # 1 + drafts for a verify segment [anchor, d1 .. dk] (set by the speculator).
    spans: list[int] = field(default_factory=list)
    # Per packed row: index into the proposer's device draft buffer, or -1 for `input_ids` (empty: all -1).
    draft_src: list[int] = field(default_factory=list)
    decode_tokens: int = 0
    prefill: list[tuple[RequestState, int]] = field(default_factory=list)  # prompt chunks written
    completed: list[RequestState] = field(default_factory=list)  # prompts finished this step

    @property
    def prefill_tokens(self) -> int:
        return sum(chunk for _, chunk in self.prefill)

    def add(self, seq: int, tokens: list[int], t_index: list[int]) -> int:
        """Append one segment; returns the packed row of its last token."""
        self.seq_ids += [seq] * len(tokens)
        self.input_ids += tokens
        self.t_index += t_index
        return len(self.seq_ids) - 1


class Scheduler:
    """FIFO admission and step packing over one cache. Host only."""

    def __init__(
        self, cache: BatchedSequenceCache, max_step_tokens: int, prefill_chunk: int, buckets: tuple[int, ...] = ()
    ) -> None:
        self.cache = cache
        self.max_step_tokens = max_step_tokens
        self.prefill_chunk = prefill_chunk
        self.buckets = buckets  # step widths; prompt chunks are trimmed to land on one
        self.waiting: deque[RequestState] = deque()
        self.prefilling: list[RequestState] = []
        self.running: deque[SampleState] = deque()
        self.live: dict[int, RequestState] = {}
        self.cancelled: list[Event] = []

    # ---- admission -----------------------------------------------------------------------------
    def add(self, state: RequestState) -> None:
        params = state.request.params
        state.samples = [SampleState(state, i) for i in range(params.n)]
        self.waiting.append(state)
        self.live[state.id] = state

    @property
    def spare(self) -> int:
        return sum(r.spare for r in self.prefilling)

    def free_columns(self) -> int:
        return self.cache.max_seqs - len(self.cache.sequences) - self.spare

    def admit(self) -> None:
        """Give columns to waiting requests, oldest first, while their n columns are free."""
        while self.waiting and self.free_columns() >= self.waiting[0].request.params.n:
            state = self.waiting[0]
            params = state.request.params
            seq = self.cache.seq_new()
            try:
                # The last generated token is never written: the longest history is one shorter.
                self.cache.reserve(min(self.cache.capacity, len(state.prompt) + params.max_new_tokens - 1))
            except BaseException:
                self.cache.seq_rm(seq)
                raise
            self.waiting.popleft()
            state.samples[0].seq, state.spare = seq, params.n - 1
            self.prefilling.append(state)

    # ---- planning ------------------------------------------------------------------------------
    def plan(self) -> Batch | None:
        """Pack the next step, or None when nothing is admitted."""
        batch = Batch()
        # A step's sampling rows fit its width (the LM head runs on min(width, 64) rows).
        budget, rows = self.max_step_tokens, min(MAX_SAMPLE_ROWS, self.max_step_tokens)
        decode_tokens, decode_rows = budget, rows
        if self.prefilling:  # the oldest prompt moves every step, and can sample when it is done
            head = self.prefilling[0]
            decode_tokens = budget - 1
            if head.remaining <= self.prefill_chunk:
                decode_rows = rows - head.request.params.n
        take = min(len(self.running), decode_tokens, decode_rows)
        for _ in range(take):
            sample = self.running.popleft()
            self.running.append(sample)  # round-robin: the deferred go first next step
            row = batch.add(sample.seq, [sample.tokens[-1]], [sample.next_t])
            batch.rows.append(row)
            batch.samples.append(sample)
        batch.decode_tokens = take
        budget, rows = budget - take, rows - take
        chunks = self._chunks(budget, rows)
        # Trim the prompt chunks so the step lands on a width bucket: padding rows cost a full
        # forward's compute, while trimmed prompt tokens simply go in the next step.
        total = take + sum(chunk for _, chunk in chunks)
        fit = max((b for b in self.buckets if take < b <= total), default=total)
        if fit < total:
            chunks = self._chunks(fit - take, rows)
        for state, chunk in chunks:
            n = state.request.params.n
            start, offset = state.prefilled, state.request.rope_offset
            tokens = list(state.prompt[start : start + chunk])
            row = batch.add(state.samples[0].seq, tokens, list(range(offset + start, offset + start + chunk)))
            batch.prefill.append((state, chunk))
            if chunk == state.remaining:
                batch.completed.append(state)
                batch.rows += [row] * n
                batch.samples += state.samples
        batch.spans = [1] * len(batch.samples)
        return batch if batch.seq_ids else None

    def _chunks(self, budget: int, rows: int) -> list[tuple[RequestState, int]]:
        """Prompt chunks (FIFO) that fit `budget` tokens and `rows` sampling rows."""
        chunks = []
        for state in self.prefilling:
            n = state.request.params.n
            chunk = min(state.remaining, self.prefill_chunk, budget)
            if chunk == state.remaining and n > rows:
                chunk -= 1  # its last token must sample; leave it for a step with rows to spare
            if chunk <= 0:
                continue
            chunks.append((state, chunk))
            budget -= chunk
            if chunk == state.remaining:
                rows -= n
        return chunks

    # ---- completion ----------------------------------------------------------------------------
    def complete(self, batch: Batch, tokens: list[list[int]], now: float) -> list[Event]:
        """Apply a committed step: record each sample's new tokens (one, or a verify segment's
        accepted run), fork, finish and free. A finish truncates the run. Returns events."""
        capacity = self.cache.capacity
        for state, chunk in batch.prefill:
            state.prefilled += chunk
        events = []
        for sample, run in zip(batch.samples, tokens, strict=True):
            state, params = sample.owner, sample.owner.request.params
            for token in run:
                if not sample.tokens:
                    sample.next_t = state.request.rope_offset + len(state.prompt)
                else:
                    sample.next_t += 1
                sample.tokens.append(token)
                sample.last_emit = now
                if token in params.stop_token_ids:
                    sample.finish = "stop"
                elif len(sample.tokens) >= params.max_new_tokens:
                    sample.finish = "length"
                elif len(state.prompt) + len(sample.tokens) > capacity:  # no position left to write it
                    sample.finish = "capacity"
                events.append(Event(state.id, token, sample.finish, sample.index))
                if sample.finish is not None:
                    break
        for state in batch.completed:
            self._fork(state)
        for sample in batch.samples:
            if sample.finish is not None and sample.seq >= 0:
                self.cache.seq_rm(sample.seq)
                sample.seq = -1
        self.running = deque(s for s in self.running if s.finish is None)
        for sample in batch.samples:
            if sample.finish is None and sample.owner in batch.completed:
                self.running.append(sample)
        for sample in batch.samples:
            if not sample.owner.live():
                self.live.pop(sample.owner.id, None)
        return events

    def _fork(self, state: RequestState) -> None:
        """After the prompt: clone its column for every other live sample; release the spares."""
        self.prefilling.remove(state)
        parent = state.samples[0].seq
        for sample in state.samples[1:]:
            if sample.finish is None:
                sample.seq = self.cache.seq_clone(parent)
        state.spare = 0

    # ---- cancellation --------------------------------------------------------------------------
    def cancel(self, request_id: int) -> bool:
        """Drop a live request now: its columns are freed; events come out of the next step."""
        state = self.live.pop(request_id, None)
        if state is None:
            return False
        if state in self.waiting:
            self.waiting.remove(state)
        if state in self.prefilling:
            self.prefilling.remove(state)
            state.spare = 0
        for sample in state.live():
            if sample.seq >= 0:
                self.cache.seq_rm(sample.seq)
                sample.seq = -1
            sample.finish = "cancelled"
            self.cancelled.append(Event(state.id, None, "cancelled", sample.index))
        self.running = deque(s for s in self.running if s.owner is not state)
        return True

    def take_cancelled(self) -> list[Event]:
        events, self.cancelled = self.cancelled, []
        return events

    @property
    def has_work(self) -> bool:
        return bool(self.live or self.cancelled)
