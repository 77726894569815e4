"""A plain-Python model of the scheduler's bookkeeping: the per-sample code the slot arrays
replaced (`batchkv/executor/scheduler.py` and `state.py` at 712b43c), kept as the oracle of
`test_scheduler_arrays.py`. Each step walks every sample as Python objects; nothing here is
vectorised. Not imported by the package."""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field, replace

from batchkv.cache import BatchedSequenceCache
from batchkv.checks import int_arg
from batchkv.executor.constraints import accept
from batchkv.executor.logprobs import row_ks
from batchkv.executor.prefix import NO_MATCH, NoPrefixCache, PrefixCache
from batchkv.executor.request import MAX_SAMPLE_ROWS, Event, Logprobs, Request
from batchkv.executor.scheduler import HEAD_SHARE, default_prefill_budget
from batchkv.executor.state import StepPlan


@dataclass(eq=False)
class ModelSample:
    """One of a request's n samples: its column, its tokens so far, and those still on the device."""

    owner: ModelRequest
    index: int
    seq: int = -1  # column; -1 until the prompt is written (sample 0) or forked (others), and once freed
    tokens: list[int] = field(default_factory=list)  # read by the host
    # Launched steps that sampled for it and were not read yet (0 or 1 at planning time); each
    # counts as one token. A verify step may emit more, known only once read: speculating engines
    # finish every step before planning the next, so they never plan with one pending.
    pending: int = 0
    finish: str | None = None
    last_emit: float = 0.0  # host time of the last token (inter-token latency)
    matcher: object = None  # constrained decoding: its xgrammar matcher, made when it first samples

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
class ModelRequest:
    """A submitted request: prompt progress and its samples."""

    id: int
    request: Request
    seed: int
    submitted: float
    prefilled: int = 0  # prompt tokens written to the cache
    cached: int = 0  # of them, those reused from the prefix cache (not computed)
    spare: int = 0  # columns held back for forks
    samples: list[ModelSample] = field(default_factory=list)
    # prompt_logprobs so far (entry 0 None: the first token has no prefix); handed out with the first token
    prompt_logprobs: list[Logprobs | None] = field(default_factory=lambda: [None])
    grammar: object = None  # constrained decoding: the compiled grammar of params.constraint

    @property
    def prompt(self) -> tuple[int, ...]:
        return self.request.prompt_ids  # type: ignore[return-value]

    @property
    def remaining(self) -> int:
        return len(self.prompt) - self.prefilled

    def live(self) -> list[ModelSample]:
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


class ModelScheduler:
    """FIFO admission and step packing over one cache. Host only."""

    def __init__(
        self,
        cache: BatchedSequenceCache,
        max_step_tokens: int,
        prefill_chunk: int,
        buckets: tuple[int, ...] = (),
        prefill_budget: int | None = None,
        sample_rows: int = MAX_SAMPLE_ROWS,
        prefix_cache: bool = False,
    ) -> None:
        if prefill_budget is not None:
            prefill_budget = int_arg("prefill_budget", prefill_budget, 1, why=" (or None: the default)")
        self.cache = cache
        # the prefix cache, or its null form: admission and release call it either way
        self.prefix: PrefixCache | NoPrefixCache = NoPrefixCache()
        if prefix_cache:
            self.prefix = PrefixCache(cache, prefill_chunk)
        self.sample_rows = sample_rows  # logits rows a step may take
        self.max_step_tokens = max_step_tokens
        self.prefill_chunk = prefill_chunk
        # prompt tokens per step while samples are running, all prompts (with none running a step takes
        # the whole step budget: there is no inter-token latency to protect)
        self.prefill_budget = prefill_budget or default_prefill_budget(max_step_tokens, prefill_chunk)
        self.buckets = buckets  # step widths; prompt chunks are trimmed to land on one
        # what a long oldest prompt is sure of per step while shorter prompts wait (`_chunks`)
        self.head_share = max(1, prefill_chunk // HEAD_SHARE)
        self.sources: dict[ModelSample, int] = {}  # sampling row of each sample in the last launched step
        self.waiting: deque[ModelRequest] = deque()
        self.prefilling: list[ModelRequest] = []
        self.running: deque[ModelSample] = deque()
        self.live: dict[int, ModelRequest] = {}
        self.cancelled: list[Event] = []
        self.scoring = 0  # live requests that ask for logprobs or prompt_logprobs

    # ---- admission -----------------------------------------------------------------------------
    def add(self, state: ModelRequest) -> None:
        params = state.request.params
        state.samples = [ModelSample(state, i) for i in range(params.n)]
        self.waiting.append(state)
        self.live[state.id] = state
        self.scoring += params.scores

    def _retire(self, state: ModelRequest) -> bool:
        """Forget a request that is no longer live; False when it was not."""
        if self.live.pop(state.id, None) is None:
            return False
        self.scoring -= state.request.params.scores
        return True

    @property
    def spare(self) -> int:
        return sum(r.spare for r in self.prefilling)

    def free_columns(self) -> int:
        return self.cache.max_seqs - len(self.cache.sequences) - self.spare

    def free_rows(self) -> int:
        """Rows the store can still give, less those held back for the forks of prompts in flight."""
        return self.cache.free_rows - sum(r.spare * self.reach(r) for r in self.prefilling)

    def reach(self, state: ModelRequest) -> int:
        """Positions one of a request's samples can hold: its prompt and every generated token but
        the last, which is never written."""
        return min(self.cache.capacity, len(state.prompt) + state.request.params.max_new_tokens - 1)

    def admit(self) -> None:
        """Give columns to waiting requests, oldest first, while their n columns and the rows of
        their n extents are free (evicting cached prefixes first). With the prefix cache a request
        starts after the longest prefix it can reuse, and one that shares more with a prompt still
        being written waits for it while the requests behind it go on."""
        for state in sorted(self.waiting, key=lambda state: state.request.priority):  # stable: FIFO within one
            params, reach = state.request.params, self.reach(state)
            match = self.prefix.lookup(state)
            if match.wait:
                continue
            columns, rows = params.n, params.n * reach
            match = self._make_room(match, columns, rows)
            columns, rows = self.prefix.room(match, columns, rows)
            if self.free_columns() < columns or self.free_rows() < rows:
                return  # FIFO: nothing behind a request that does not fit goes before it (nor less urgent)
            seq = self.prefix.place(match, reach) if match.history is not None else self.cache.seq_new(reach=reach)
            self.waiting.remove(state)
            state.samples[0].seq, state.spare, state.prefilled = seq, params.n - 1, match.length
            state.cached = match.length
            self.prefilling.append(state)
            self.prefix.add_live(state)

    def _make_room(self, match, columns: int, rows: int):
        """Evict cached histories (least recently used first) until a request of `columns` samples
        and `rows` positions fits beside the history it reuses; when even that is not enough, it
        takes the cached history's column over (better than recomputing the prefix), and when that
        is not enough either while nothing runs that could free rows (the history is taller than
        the request's reach and its forks need the rest), the history goes too and the prompt is
        computed (waiting would never end). Returns the match as it will be used."""
        prefix = self.prefix
        cached = match.history is not None and match.history.live is None
        attempts = [match, replace(match, take=True)] if cached else [match]
        if cached and not self.prefilling and not self.running:
            attempts.append(NO_MATCH)
        for attempt in attempts:
            need_cols, need_rows = prefix.room(attempt, columns, rows)
            short_cols, short_rows = need_cols - self.free_columns(), need_rows - self.free_rows()
            if short_cols > 0 or short_rows > 0:
                prefix.evict(max(short_cols, 0), max(short_rows, 0), keep=attempt.history)
            if self.free_columns() >= need_cols and self.free_rows() >= need_rows:
                return attempt
        return attempts[-1] if attempts[-1] is NO_MATCH else match  # (the history may be evicted)

    # ---- planning ------------------------------------------------------------------------------
    def _urgent(self) -> tuple[list[ModelRequest], deque[ModelSample] | None]:
        """The admitted prompts and running samples of the most urgent priority that holds a column
        (`Request.priority`): the only ones a step takes. None for the samples when every running
        one is of that priority (the common case: self.running as it is)."""
        priorities = {state.request.priority for state in self.prefilling}
        priorities.update(sample.owner.request.priority for sample in self.running)
        if len(priorities) <= 1:
            return self.prefilling, None
        level = min(priorities)
        prefilling = [state for state in self.prefilling if state.request.priority == level]
        return prefilling, deque(sample for sample in self.running if sample.owner.request.priority == level)

    def plan(self) -> StepPlan | None:
        """Pack the next step, or None when nothing is admitted."""
        batch = StepPlan()
        prefilling, urgent = self._urgent()
        running = self.running if urgent is None else urgent
        # A step's sampling rows fit its width (the LM head runs on min(width, sample_rows) rows).
        budget, rows = self.max_step_tokens, min(self.sample_rows, self.max_step_tokens)
        decode_tokens, decode_rows = budget, rows
        # prompts share the step with running samples, whose next token waits for it: the prefill budget
        # binds (with nothing running, the step is the prompts' alone)
        prefill_cap = self.prefill_budget if running else budget
        if prefilling:  # the oldest prompt moves every step, and can sample when it is done
            head = prefilling[0]
            decode_tokens = budget - 1
            chunk = min(head.remaining, self.prefill_chunk, prefill_cap)
            if chunk == head.remaining or head.request.params.prompt_logprobs is not None:  # its rows
                decode_rows = rows - min(head.rows_for(chunk), max(rows // 2, head.request.params.n))
        take = min(len(running), decode_tokens, decode_rows)
        taken = list(itertools.islice(running, take))
        if urgent is None:
            self.running.rotate(-take)  # round-robin: the deferred go first next step
        else:  # the same among the urgent; the paused keep their places
            picked = set(taken)
            self.running = deque([s for s in self.running if s not in picked] + taken)
        sources = []
        for sample in taken:
            # A pending newest token is still on the device: the row gathers it from there.
            sources.append(self.sources[sample] if sample.pending else -1)
            row = batch.add(sample.seq, [0 if sample.pending else sample.tokens[-1]], [sample.next_t])
            batch.rows.append(row)
            batch.samples.append(sample)
        batch.decode_tokens = take
        budget, rows = min(budget - take, prefill_cap), rows - take
        chunks = self._chunks(prefilling, budget, rows)
        # Trim the prompt chunks so the step lands on a width bucket: padding rows cost a full
        # forward's compute, while trimmed prompt tokens simply go in the next step.
        total = take + sum(chunk for _, chunk in chunks)
        fit = max((b for b in self.buckets if take < b <= total), default=total)
        if fit < total:
            chunks = self._chunks(prefilling, fit - take, rows)
        for state, chunk in chunks:
            n = state.request.params.n
            start, offset = state.prefilled, state.request.rope_offset
            tokens = list(state.prompt[start : start + chunk])
            row = batch.add(state.samples[0].seq, tokens, list(range(offset + start, offset + start + chunk)))
            batch.prefill.append((state, chunk))
            if state.request.params.prompt_logprobs is not None:
                scored = chunk - (chunk == state.remaining)  # the last prompt row samples instead
                batch.score_rows += range(row - chunk + 1, row - chunk + 1 + scored)
                batch.score_tokens += state.prompt[start + 1 : start + 1 + scored]
                batch.scores.append((state, scored))
            if chunk == state.remaining:
                batch.completed.append(state)
                batch.rows += [row] * n
                batch.samples += state.samples
        batch.spans = [1] * len(batch.samples)
        if any(src >= 0 for src in sources):
            batch.token_src = sources + [-1] * (len(batch.seq_ids) - take)
        if self.scoring:
            batch.logprob_k = row_ks(batch)
        return batch if batch.seq_ids else None

    def _chunks(self, prefilling: list[ModelRequest], budget: int, rows: int) -> list[tuple[ModelRequest, int]]:
        """Chunks of `prefilling`'s prompts that fit `budget` tokens and `rows` logits rows: the oldest
        prompt first (it moves every step, so none waits forever), then the others shortest remaining
        first (a short prompt is not held behind a long one). While others wait, a long oldest prompt
        (more than a chunk left) first takes `head_share` tokens, then what the others leave, up to a
        chunk."""
        if not prefilling:
            return []
        head, *rest = prefilling
        rest.sort(key=lambda state: state.remaining)  # stable: ties in admission order
        capped = bool(rest) and head.remaining > self.prefill_chunk
        limits = [(head, self.head_share if capped else self.prefill_chunk)]
        chunks = []
        for state, limit in limits + [(state, self.prefill_chunk) for state in rest]:
            chunk = state.fit(min(state.remaining, limit, budget), rows)
            if chunk <= 0:
                continue
            chunks.append((state, chunk))
            budget -= chunk
            rows -= state.rows_for(chunk)
        if capped and budget > 0 and chunks and chunks[0][0] is head:  # the others took less than the budget
            taken = chunks[0][1]
            grown = head.fit(min(self.prefill_chunk, taken + budget), rows + head.rows_for(taken))
            chunks[0] = (head, max(grown, taken))
        return chunks

    # ---- completion ----------------------------------------------------------------------------
    def launched(self, batch: StepPlan) -> None:
        """Apply what a queued and committed step changes before its tokens are read: prompt
        progress, one pending token per sampling row, forks after a finished prompt, and the
        columns of samples that cannot be fed again (max_new_tokens or capacity reached: their
        last token is never written), so the next plan can admit into them."""
        for state, chunk in batch.prefill:
            state.prefilled += chunk
        self.sources = {}
        for row, sample in enumerate(batch.samples):
            sample.pending += 1
            self.sources[sample] = row
        capacity = self.cache.capacity
        for state in batch.completed:
            self._fork(state)
            self.running += [s for s in state.samples if s.finish is None]
        for sample in batch.samples:
            if sample.seq >= 0 and sample.exhausted(capacity):
                self._release(sample)
        self.running = deque(s for s in self.running if s.seq >= 0)

    def complete(
        self, batch: StepPlan, tokens: list[list[int]], now: float, logprobs: tuple[list, list] | None = None
    ) -> list[Event]:
        """Apply a launched step's tokens, read on the host: record each sample's new tokens (one,
        or a verify segment's accepted run), finish, free. A finish truncates the run; a sample that
        finished or was cancelled since the step was launched has its token discarded (its column
        is already free, or freed here: the K/V the step wrote there is never read). `logprobs`:
        the step's (`StepLogprobs.read()`), when some row asked. Returns events."""
        capacity = self.cache.capacity
        events = []
        sampled, scored = logprobs if logprobs is not None else ([None] * len(batch.samples), [])
        at = 0
        for state, count in batch.scores:  # prompt_logprobs, in prompt order
            state.prompt_logprobs += scored[at : at + count]
            at += count
        for sample, run, lp in zip(batch.samples, tokens, sampled, strict=True):
            sample.pending -= 1
            if sample.finish is not None:
                continue
            state, params = sample.owner, sample.owner.request.params
            prompt_lps = None
            if params.prompt_logprobs is not None and sample.index == 0 and not sample.tokens:
                prompt_lps, state.prompt_logprobs = tuple(state.prompt_logprobs), []
            for token in run:
                grammar = accept(sample.matcher, token) if sample.matcher is not None else None
                if grammar == "grammar":  # no token could continue it: ends without the token
                    sample.finish = "grammar"
                    events.append(Event(state.id, None, "grammar", sample.index, None, prompt_lps))
                    break
                sample.tokens.append(token)
                sample.last_emit = now
                if token in params.stop_token_ids or grammar == "stop":
                    sample.finish = "stop"
                elif len(sample.tokens) >= params.max_new_tokens:
                    sample.finish = "length"
                elif len(state.prompt) + len(sample.tokens) > capacity:  # no position left to write it
                    sample.finish = "capacity"
                events.append(Event(state.id, token, sample.finish, sample.index, lp, prompt_lps))
                prompt_lps = None
                if sample.finish is not None:
                    break
        for sample in batch.samples:
            if sample.finish is not None and sample.seq >= 0:
                self._release(sample)
        self.running = deque(s for s in self.running if s.finish is None)
        for sample in batch.samples:
            if not sample.owner.live():
                self._retire(sample.owner)
        return events

    def _release(self, sample: ModelSample, keep: bool = True) -> None:
        """Free a sample's column, or with the prefix cache (`keep`: it finished) keep it cached."""
        if sample.index == 0:
            self.prefix.end_live(sample.owner)
        if keep and self.prefix.keep(sample):
            sample.seq = -1
            return
        self.cache.seq_rm(sample.seq)
        sample.seq = -1

    def _fork(self, state: ModelRequest) -> None:
        """After the prompt is queued: clone its column for every other sample that will decode
        (the clone is a device copy queued after the prompt's K/V writes); release the spares."""
        self.prefilling.remove(state)
        parent = state.samples[0].seq
        for sample in state.samples[1:]:
            if sample.finish is None and not sample.exhausted(self.cache.capacity):
                # as tall as admission held back for it (an adopted parent may be taller)
                sample.seq = self.cache.seq_clone(parent, reach=self.reach(state))
        state.spare = 0

    # ---- cancellation --------------------------------------------------------------------------
    def cancel(self, request_id: int) -> bool:
        """Drop a live request now: its columns are freed; events come out of the next step."""
        state = self.live.get(request_id)
        if state is None or not self._retire(state):
            return False
        if state in self.waiting:
            self.waiting.remove(state)
        if state in self.prefilling:
            self.prefilling.remove(state)
            state.spare = 0
        for sample in state.live():
            if sample.seq >= 0:
                self._release(sample, keep=False)
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
