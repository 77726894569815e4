"""Host planning of continuous batching: admission, step packing, forks and finishes.

Pure bookkeeping over `BatchedSequenceCache`'s BatchControl verbs; no tensors. Each step packs, in
order: one decode token per running sample (round-robin when a step cannot take them all), then
chunks of admitted prompts within the token budget and, while samples are running, the prefill
budget (`default_prefill_budget`): the oldest prompt's first (a long one's capped at a quarter
chunk while others wait), then the others' shortest remaining first. A prompt may take several
steps; the step that writes its last token samples its first token(s), and a request with n > 1
then forks with `seq_clone` into n sequences that decode independently.

A step is applied in two halves, so the host can plan the next step before this one's tokens are
read (`batchkv.executor.pipeline`): `launched(batch)` right after the step is queued and committed
(prompt progress, forks, one pending token per sampling row, and the columns of samples that just
sampled their last possible token under max_new_tokens or capacity), and `complete(batch, runs)`
once its tokens are on the host (tokens, stop finishes, events; a constrained sample's matcher
advances on each recorded token, `batchkv.executor.constraints`). A sample whose newest token is
still pending decodes from the device: its row's id is gathered from the launched step's sampled
tokens (`StepPlan.token_src`).

A prompt chunk with `prompt_logprobs` sends each row through the LM head (the row scores the next
prompt token), trimmed to the logits rows left; at the head of the queue it keeps up to half of them
against decode. `StepPlan.logprob_k` is planned only while a live request asks for logprobs.

Admission (columns, reach, rows held back for forks, eviction) is `batchkv.executor.admission`.
"""

from __future__ import annotations

from collections import deque
from itertools import chain

import numpy as np

from batchkv.cache import BatchedSequenceCache
from batchkv.checks import int_arg
from batchkv.executor.admission import Admission
from batchkv.executor.logprobs import row_ks
from batchkv.executor.prefix import NoPrefixCache, PrefixCache
from batchkv.executor.record import record_plain, record_runs
from batchkv.executor.request import MAX_SAMPLE_ROWS, Event
from batchkv.executor.slots import SlotTable
from batchkv.executor.state import RequestState, SampleState, StepPlan

HEAD_SHARE = 4  # a long oldest prompt takes a chunk / 4 first while others wait (bench/long_context.py)
NO_SLOTS = np.zeros(0, dtype=np.int64)

__all__ = ["RequestState", "SampleState", "Scheduler", "StepPlan", "default_prefill_budget"]


def default_prefill_budget(max_step_tokens: int, prefill_chunk: int) -> int:
    """Prompt tokens a step carries while samples run when `prefill_budget` is None: half the step
    budget, at least one chunk. Measured on the H200 (bench/results/serve-sweep-h200.json, 8B
    shape, 1,024-token steps, 512-token chunks, with the budget then binding every step): 512
    served the most tokens/s with inter-token p99 2.0x p50; 1,024 (the whole step) 2.4% fewer
    tokens/s with p99 3.5x p50; 256 1.2% fewer. At that shape half the step and one chunk are the
    same 512; the rule between them is a choice, not a measurement."""
    return max(prefill_chunk, max_step_tokens // 2)


def _add_chunk(
    chunks: list[tuple[RequestState, int]], state: RequestState, limit: int, budget: int, rows: int
) -> tuple[int, int]:
    """Append `state`'s chunk of at most `limit` tokens that fits `budget` tokens and `rows` logits
    rows (none when nothing fits); returns the budget and rows left."""
    chunk = state.fit(min(state.remaining, limit, budget), rows)
    if chunk <= 0:
        return budget, rows
    chunks.append((state, chunk))
    return budget - chunk, rows - state.rows_for(chunk)


class Scheduler(Admission):
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
        self.table = SlotTable()  # every held sample's step state, by slot (`batchkv.executor.slots`)
        self.waiting: deque[RequestState] = deque()
        self.prefilling: list[RequestState] = []
        self.forking: list[RequestState] = []  # prefilling with spare > 0 (n > 1): what `spare` sums
        self._running = NO_SLOTS  # slots of the running samples, in round-robin order
        self.live: dict[int, RequestState] = {}
        self.cancelled: list[Event] = []
        self.scoring = 0  # live requests that ask for logprobs or prompt_logprobs
        self._retired: list[SampleState] = []  # samples of retired requests whose slots a launched step may name
        self.finishes: list[str] = []  # the finish reasons of the samples the last `complete` finished

    @property
    def running(self) -> list[SampleState]:
        """The running samples (prompt written, not finished), in round-robin order."""
        return self.table.samples[self._running].tolist()

    # ---- admission -----------------------------------------------------------------------------
    def add(self, state: RequestState) -> None:
        """Queue a submitted request; each of its samples takes a slot of the table."""
        request, params = state.request, state.request.params
        prompt = len(state.prompt)
        state.samples = [SampleState(state, i) for i in range(params.n)]
        for sample in state.samples:
            self.table.take(
                sample, t0=request.rope_offset + prompt - 1, max_new=params.max_new_tokens, prompt=prompt,
                limit=min(params.max_new_tokens, self.cache.capacity - prompt + 1), priority=request.priority,
                request=state.id, submitted=state.submitted, stops=params.stop_token_ids,
                plain=state.grammar is None and params.prompt_logprobs is None, params=params, seed=state.seed,
            )  # fmt: skip
        self.queue(state)
        self.live[state.id] = state
        self.scoring += params.scores

    def _retire(self, state: RequestState) -> bool:
        """Forget a request that is no longer live; False when it was not. Its slots are freed by
        `_free_retired` once no launched step names them."""
        if self.live.pop(state.id, None) is None:
            return False
        self.scoring -= state.request.params.scores
        self._retired += state.samples
        return True

    def _free_retired(self) -> None:
        """Free the slots of retired samples that no launched, unread step names (pending 0)."""
        keep = []
        for sample in self._retired:
            if sample.slot < 0:
                continue
            if sample.pending:
                keep.append(sample)
                continue
            slot = sample.slot
            sample.detach()
            self.table.give(slot)
        self._retired = keep

    # ---- planning ------------------------------------------------------------------------------
    def _urgent(self) -> tuple[list[RequestState], np.ndarray | None]:
        """The admitted prompts and running samples (slots) of the most urgent priority that holds a
        column (`Request.priority`): the only ones a step takes. None for the samples when every
        running one is of that priority (the common case: all of `_running`)."""
        priorities = {state.request.priority for state in self.prefilling}
        running = self._running
        levels = self.table.priority[running]
        if len(levels):
            priorities.update((int(levels.min()), int(levels.max())))
        if len(priorities) <= 1:
            return self.prefilling, None
        level = min(priorities)
        prefilling = [state for state in self.prefilling if state.request.priority == level]
        return prefilling, running[levels == level]

    def plan(self) -> StepPlan | None:
        """Pack the next step, or None when nothing is admitted."""
        batch = StepPlan()
        prefilling, urgent = self._urgent()
        running = self._running if urgent is None else urgent
        # A step's sampling rows fit its width (the LM head runs on min(width, sample_rows) rows).
        budget, rows = self.max_step_tokens, min(self.sample_rows, self.max_step_tokens)
        decode_tokens, decode_rows = budget, rows
        # prompts share the step with running samples, whose next token waits for it: the prefill budget
        # binds (with nothing running, the step is the prompts' alone)
        prefill_cap = self.prefill_budget if len(running) else budget
        if prefilling:  # the oldest prompt moves every step, and can sample when it is done
            head = prefilling[0]
            decode_tokens = budget - 1
            chunk = min(head.remaining, self.prefill_chunk, prefill_cap)
            if chunk == head.remaining or head.request.params.prompt_logprobs is not None:  # its rows
                decode_rows = rows - min(head.rows_for(chunk), max(rows // 2, head.request.params.n))
        take = min(len(running), decode_tokens, decode_rows)
        taken = running[:take]
        if urgent is None:  # round-robin: the deferred go first next step
            if take < len(running):
                self._running = np.concatenate((running[take:], taken))
        else:  # the same among the urgent; the paused keep their places
            picked = np.isin(self._running, taken)
            self._running = np.concatenate((self._running[~picked], taken))
        sources = self._decode_rows(batch, taken)
        budget, rows = min(budget - take, prefill_cap), rows - take
        chunks = self._chunks(prefilling, budget, rows)
        # Trim the prompt chunks so the step lands on a width bucket: padding rows cost a full
        # forward's compute, while trimmed prompt tokens simply go in the next step.
        total = take + sum(chunk for _, chunk in chunks)
        fit = max((b for b in self.buckets if take < b <= total), default=total)
        if fit < total:
            chunks = self._chunks(prefilling, fit - take, rows)
        self._prompt_rows(batch, chunks)
        batch.spans = [1] * len(batch.samples)
        if len(batch.samples) > take:
            batch.slots = np.concatenate((taken, [s.slot for s in batch.samples[take:]]))
        if sources is not None and len(batch.seq_ids) > take:
            batch.token_src = sources + [-1] * (len(batch.seq_ids) - take)
        if self.scoring:
            batch.logprob_k = row_ks(batch)
        return batch if batch.seq_ids else None

    def _decode_rows(self, batch: StepPlan, taken: np.ndarray) -> list[int] | None:
        """One decode row per sample of `taken` (slots), from the table's columns: its column, its
        newest token (0 when still pending: the row gathers it on the device from the launched
        step's sampling row, returned as the rows' token sources; None when none is pending) and
        its RoPE t."""
        table, take = self.table, len(taken)
        pending = table.pending[taken]
        waits = pending > 0
        arrays = {
            "seq_ids": table.seq[taken],
            "input_ids": np.where(waits, 0, table.last[taken]),
            "t_index": table.t0[taken] + table.read[taken] + pending,
            "rows": np.arange(take),
        }
        if waits.any():
            arrays["token_src"] = np.where(waits, table.src[taken], -1)
        for name, array in arrays.items():  # the lists, and the arrays kept for staging (`StepPlan.ints`)
            values = array.tolist()
            setattr(batch, name, values)
            batch.arrays[name] = (values, array)
        batch.samples = table.samples[taken].tolist()
        batch.slots, batch.table = taken, table
        batch.decode_tokens = take
        return batch.token_src if waits.any() else None

    def _prompt_rows(self, batch: StepPlan, chunks: list[tuple[RequestState, int]]) -> None:
        """The prompt chunks' rows after the decode rows; a prompt's last chunk samples its n rows."""
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

    def _chunks(self, prefilling: list[RequestState], budget: int, rows: int) -> list[tuple[RequestState, int]]:
        """Chunks of `prefilling`'s prompts that fit `budget` tokens and `rows` logits rows: the oldest
        prompt first (it moves every step, so none waits forever), then the others shortest remaining
        first (a short prompt is not held behind a long one). While others wait, a long oldest prompt
        (more than a chunk left) first takes `head_share` tokens, then what the others leave, up to a
        chunk."""
        if not prefilling:
            return []
        head, *rest = prefilling
        capped = bool(rest) and head.remaining > self.prefill_chunk
        chunks: list[tuple[RequestState, int]] = []
        budget, rows = _add_chunk(chunks, head, self.head_share if capped else self.prefill_chunk, budget, rows)
        if rows <= 0:  # no logits row left: only a prompt's non-final chunk can go, never its last token
            rest = [state for state in rest if state.remaining > 1 and state.request.params.prompt_logprobs is None]
        rest.sort(key=lambda state: state.remaining)  # stable: ties in admission order
        for state in rest:
            if budget <= 0:  # no chunk fits any more
                break
            budget, rows = _add_chunk(chunks, state, self.prefill_chunk, budget, rows)
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
        table, slots = self.table, batch.slots
        table.pending[slots] += 1
        table.src[slots] = np.arange(len(slots))  # where the next plan gathers a pending token
        for state in batch.completed:
            self._fork(state)
            started = [s.slot for s in state.samples if s.finish is None]
            self._running = np.concatenate((self._running, np.asarray(started, dtype=np.int64)))
        held = table.seq[slots] >= 0
        exhausted = held & (table.read[slots] + table.pending[slots] >= table.limit[slots])
        ends = bool(exhausted.any())
        if ends:
            for slot in slots[exhausted].tolist():
                self._release(table.samples[slot])
        if batch.completed or ends:
            self._running = self._running[table.seq[self._running] >= 0]

    def complete(
        self, batch: StepPlan, tokens: list[list[int]], now: float, logprobs: tuple[list, list] | None = None
    ) -> list[Event]:
        """Apply a launched step's tokens, read on the host: record each sample's new tokens (one,
        or a verify segment's accepted run), finish, free. A finish truncates the run; a sample that
        finished or was cancelled since the step was launched has its token discarded (its column
        is already free, or freed here: the K/V the step wrote there is never read). `logprobs`:
        the step's (`StepLogprobs.read()`), when some row asked. Returns events."""
        sampled, scored = logprobs if logprobs is not None else ([None] * len(batch.samples), [])
        at = 0
        for state, count in batch.scores:  # prompt_logprobs, in prompt order
            state.prompt_logprobs += scored[at : at + count]
            at += count
        slots = batch.slots
        flat = getattr(tokens, "flat", None)  # `OneEach`: one token a row, as an array already
        if flat is None:
            flat = np.fromiter(chain.from_iterable(tokens), dtype=np.int64)
        if len(flat) == len(tokens) and self.table.plain[slots].all():  # one token a row (a run has >= 1)
            events, finished = record_plain(self.table, batch, flat, now, sampled)
        else:
            events, finished = record_runs(self.table, batch, tokens, now, sampled, self.cache.capacity)
        self.finishes = [sample.finish for sample in finished]  # one event each carries its reason
        for sample in finished:
            if sample.seq >= 0:
                self._release(sample)
        if finished:
            self._running = self._running[~self.table.done[self._running]]
            for sample in finished:
                if not sample.owner.live():
                    self._retire(sample.owner)
        self._free_retired()
        return events

    def _release(self, sample: SampleState, keep: bool = True) -> None:
        """Free a sample's column, or with the prefix cache (`keep`: it finished) keep it cached."""
        if sample.index == 0:
            self.prefix.end_live(sample.owner)
        if keep and self.prefix.keep(sample):
            sample.seq = -1
            return
        self.cache.seq_rm(sample.seq)
        sample.seq = -1

    def _fork(self, state: RequestState) -> None:
        """After the prompt is queued: clone its column for every other sample that will decode
        (the clone is a device copy queued after the prompt's K/V writes); release the spares."""
        self._end_prefill(state)
        parent = state.samples[0].seq
        for sample in state.samples[1:]:
            if sample.finish is None and not sample.exhausted(self.cache.capacity):
                # as tall as admission held back for it (an adopted parent may be taller)
                sample.seq = self.cache.seq_clone(parent, reach=self.horizon(state))

    def _end_prefill(self, state: RequestState) -> None:
        """The prompt is written or dropped: it leaves `prefilling`, and with it the columns and
        rows it held back for its forks (`forking`, `spare`)."""
        self.prefilling.remove(state)
        if state.spare:
            self.forking.remove(state)
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
            self._end_prefill(state)
        for sample in state.live():
            if sample.seq >= 0:
                self._release(sample, keep=False)
            sample.finish = "cancelled"
            self.cancelled.append(Event(state.id, None, "cancelled", sample.index))
        self._running = self._running[~self.table.done[self._running]]
        self._free_retired()
        return True

    def take_cancelled(self) -> list[Event]:
        events, self.cancelled = self.cancelled, []
        return events

    @property
    def has_work(self) -> bool:
        return bool(self.live or self.cancelled)
