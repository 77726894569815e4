"""The model runner: static step inputs on the device, one forward (eager or a replayed CUDA graph),
and sampling, queued without waiting for the device.

Every per-step input lives in fixed-address device tensors sized at the largest width bucket: the logits selector
int64 [R], the sampling parameters [R], token ids, RoPE indexes and token sources as one int64 [5, W] block per width
(contiguous, so a step of width W reads a prefix of the buffer), and the logits out float32 [R, vocab] ([HEAD_CHUNK,
vocab] when the head runs in chunks), R the engine's logits rows per step (min(max_seqs, MAX_SAMPLE_ROWS)). The host
writes them through `Staging` (one pinned buffer per dtype, copied over asynchronously, the int64 one up to the step's
width); nothing else crosses. With a `GraphSet` the forward is captured once per (width bucket, cache generation,
module fingerprint) and replayed afterwards; a new mix of lengths only changes the contents of the cache's buffers.
The key's head also says whether every run of the step is short (`cache.short_step`: decode, verify blocks), whose
attention skips the prompt-chunk launch (`execute`, `warm`).

Sampled tokens stay on the device: `sampled` int64 [2, R] holds two launches' tokens (slots alternate between
consecutive launches), and a row whose token source is r >= 0 takes its id from the previous launch's slot, row r,
gathered inside the captured forward. Each launch also queues a copy of its tokens into a pinned host slot and records
an event; `SampledTokens.read()` waits on that event: the step's one host synchronisation, which the engine defers
until the next step is queued (see `batchkv.executor.pipeline`).

Log-probabilities (`batchkv.executor.logprobs`) follow the same path when a step's rows ask for them: prompt scoring
rows join the selector after the sampling rows, and the logprobs are copied into pinned host slots before the event,
read with the tokens. A step where no row asks stages, launches and copies exactly what it did before they existed.

So do the per-row logit adjustments (penalties, logit_bias, min_tokens, min_p) and constrained decoding: a step where
a row uses one runs `_adjusted_step` (the forward, then the host's staging and bitmask fill while the device runs it,
then sampling from the adjusted logits); any other step runs `_device_step`, unchanged.

A step of more than HEAD_CHUNK (256) logits rows of a `chunkable` model (HFModel, SenseNova) runs `_chunked_step`: the
forward (eager or the graph) stops at the final-normed hidden states, then per chunk of `head_chunks` of the step's
logits rows (not the rows its width pads to) the float32 logits are made in the one [256, vocab] buffer, sampled
(`batchkv.executor.rows.adjuster` for the adjustments) and scored before the next chunk overwrites them (at the 8B
shape 131 MB instead of 525 MB at 1,024 rows, and the sampler's sort bounded alike). Up to 256 rows, or with another
model, the unchunked path above runs unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from batchkv.cache import BatchedSequenceCache
from batchkv.cache.staging import Staging
from batchkv.cache.views import SHORT_RUN
from batchkv.errors import StepError
from batchkv.executor.constraints import Grammars, MaskRows, constrained
from batchkv.executor.graphs import AdapterGuard, GraphSet, ModelFingerprint
from batchkv.executor.logprobs import LogprobPlan, LogprobSlots, StepLogprobs
from batchkv.executor.pipeline import SampledTokens
from batchkv.executor.request import MAX_SAMPLE_ROWS, StepModel
from batchkv.executor.roles import LOCAL, Role
from batchkv.executor.rows import HEAD_CHUNK, Adjust, adjuster, any_adjusts, chunkable, head_chunks, stage_sampling
from batchkv.executor.sampling import greedy_tokens, sample_tokens
from batchkv.executor.scheduler import StepPlan


class ModelRunner:
    """Runs planned steps of `model` over `cache`.

    model(input_ids [W], indexes [3, W], cache, logits_rows [rows]) -> float32 [rows, vocab].
    rows: most logits rows a step takes (R, at most MAX_SAMPLE_ROWS): sampling rows, then prompt
    scoring rows (prompt_logprobs).
    pad_rows: pad the selector to min(width, R) rows (padding reads row 0), so the LM head has one
    shape per width: needed for graphs, and used by eager CUDA runs too so both give identical
    numbers. A one-token decode step runs the head on one row, not R. The engine picks a width
    of at least the step's sampling rows.
    role: the engine's tensor-parallel role (`batchkv.executor.roles`); its device step
    (`_device_step`) runs through `role.run`, so every rank runs it from the same staged inputs.
    """

    def __init__(
        self,
        model: StepModel,
        cache: BatchedSequenceCache,
        max_width: int,
        *,
        graphs: GraphSet | None = None,
        pad_rows: bool = False,
        rows: int = MAX_SAMPLE_ROWS,
        role: Role = LOCAL,
    ) -> None:
        self._bind(model, cache, max_width, graphs)
        self.pad_rows = pad_rows or graphs is not None
        self.rows = R = rows
        w, device = max_width, cache.device
        # int64: [logits_rows R | top_k R | a step of width W: [5, W] = input_ids, indexes (3 rows),
        # token_src]; float32: [temperature | top_p | draws]. What a step of width W reads is the
        # prefix [0, 2R + 5W) of the int64 buffer: one copy per dtype, its bytes following the width.
        self._staging = Staging(self.sizes(w, R), device)
        self._dev_i64 = self._staging.device_buffers[torch.int64]
        self._input_views: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # `_inputs`, by width
        self._on_cpu = device.type == "cpu"
        self.logits_rows = self._dev_i64[:R]
        self.top_k = self._dev_i64[R : 2 * R]
        self.temperature, self.top_p, self.draws = self._staging.device_buffers[torch.float32].view(3, R).unbind(0)
        self.chunked = R > HEAD_CHUNK and chunkable(model)  # steps past HEAD_CHUNK rows run the head in chunks
        buffer_rows = self.logit_rows(R, self.chunked)
        self.logits = torch.zeros(buffer_rows, model.vocab_size, dtype=torch.float32, device=device)
        pin = device.type == "cuda"
        self.sampled = torch.zeros(2, R, dtype=torch.int64, device=device)  # two launches' tokens
        self._host_tokens = torch.zeros(2, R, dtype=torch.int64, pin_memory=pin)
        self._host_tokens_np = self._host_tokens.numpy()  # (a view: the CPU stages pending tokens from it)
        self._read = [torch.cuda.Event() for _ in range(2)] if pin else [None, None]
        self.logprob_slots = LogprobSlots(R, device)  # used only by steps whose rows ask (rank 0's)
        self.grammars: Grammars | None = None  # `Engine.use_tokenizer`: constrained decoding
        self._masks: MaskRows | None = None  # its bitmask buffers, made at the first constrained step
        self._scoring: LogprobPlan | None = None  # a chunked step's logprob plan (rank 0's; None elsewhere)
        self._parts: list[tuple[torch.Tensor, torch.Tensor]] = []  # its logprobs, chunk by chunk
        self.role = role
        role.bind(self, self._staging)

    @staticmethod
    def logit_rows(rows: int, chunked: bool) -> int:
        """Rows of the float32 logits buffer: `rows`, or HEAD_CHUNK when the head runs in chunks."""
        return min(rows, HEAD_CHUNK) if chunked else rows

    @staticmethod
    def sizes(max_width: int, rows: int) -> dict[torch.dtype, int]:
        """Elements per dtype of the staged step inputs."""
        return {torch.int64: 2 * rows + 5 * max_width, torch.float32: 3 * rows}

    @staticmethod
    def nbytes(max_width: int, vocab_size: int, rows: int = MAX_SAMPLE_ROWS, chunked: bool = False) -> int:
        """Bytes a runner allocates: staged inputs (host and device), the float32 logits [rows, vocab]
        ([HEAD_CHUNK, vocab] when `chunked`), the sampled tokens (two slots, device and host) and the
        logprob slots."""
        staged = Staging.nbytes(ModelRunner.sizes(max_width, rows))
        logits = 4 * ModelRunner.logit_rows(rows, chunked) * vocab_size
        return staged + logits + 4 * 8 * rows + LogprobSlots.nbytes(rows)

    def _bind(self, model: StepModel, cache: BatchedSequenceCache, max_width: int, graphs: GraphSet | None) -> None:
        self.model, self.cache, self.max_width, self.graphs = model, cache, max_width, graphs
        self.fingerprint = fingerprint = ModelFingerprint(model)
        # Adapter wrappers (LoRA) switch branches without changing the tree: no graph while they exist.
        # (The lambda holds the fingerprint, not the runner: no reference cycle keeps a dropped engine alive.)
        self.adapters = AdapterGuard(fingerprint, lambda: [m for _, m in fingerprint.modules()])
        self._bound: tuple[int, int] | None = None  # (generation, fingerprint) the kept graphs bind

    def _inputs(self, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The device inputs of a step of `width`, views of int64 [5, width]: ids [width], indexes
        t/h/w [3, width], token_src [width]. Made once per width (the buffer never moves)."""
        views = self._input_views.get(width)
        if views is None:
            block = self._dev_i64[2 * self.rows : 2 * self.rows + 5 * width].view(5, width)
            views = self._input_views[width] = (block[0], block[1:4], block[4])
        return views

    def input_ids(self, width: int) -> torch.Tensor:
        return self._inputs(width)[0]

    def indexes(self, width: int) -> torch.Tensor:
        return self._inputs(width)[1]

    def token_src(self, width: int) -> torch.Tensor:
        """Per packed row: -1 (the staged id), else the row of `sampled` (both slots, flat) it takes."""
        return self._inputs(width)[2]

    @property
    def captures(self) -> int:
        return self.graphs.captures if self.graphs is not None else 0

    @property
    def replays(self) -> int:
        return self.graphs.replays if self.graphs is not None else 0

    def _stage(self, batch: StepPlan, width: int, previous: SampledTokens | None) -> bool:
        """Write the step's inputs to the device buffers; True when some row samples (not greedy)."""
        staged = self._staging.begin()  # waits for the previous upload (queued before the last forward)
        n, rows, R = len(batch.input_ids), len(batch.rows), self.rows
        host = staged[torch.int64]
        inputs = host[2 * R : 2 * R + 5 * width].reshape(5, width)
        inputs[:4] = 0  # padding feeds token 0 (its K/V go to the scratch column); text tokens: (t, 0, 0)
        inputs[0, :n] = batch.ints("input_ids")
        inputs[1, :n] = batch.ints("t_index")
        src = inputs[4]
        src[:] = -1
        # Eager steps whose ids are all staged skip the gather; a graph holds it whatever the step.
        # On the CPU an eager step's pending tokens are in host memory already (the previous
        # launch copied them there before returning): staged here, so no step gathers.
        on_host = self.graphs is None and self._on_cpu
        self._gather = (bool(batch.token_src) and not on_host) or self.graphs is not None
        if batch.token_src:
            if previous is None:
                raise StepError("a planned row feeds a pending token, but no launched step holds it")
            token_src = batch.ints("token_src")
            if on_host:
                tokens, pending = self._host_tokens_np[previous.slot], token_src >= 0
                if pending.all():  # a steady step under overlap: every row feeds its pending token
                    inputs[0, :n] = tokens[token_src]
                else:
                    inputs[0, :n][pending] = tokens[token_src[pending]]
            else:
                src[:n] = token_src
                src[:n][src[:n] >= 0] += previous.slot * R  # rows of the previous launch's slot
        selector, top_k = host[:R], host[R : 2 * R]
        selector[:] = 0
        selector[:rows] = batch.ints("rows")
        if batch.score_rows:  # prompt_logprobs: after the sampling rows
            selector[rows : rows + len(batch.score_rows)] = batch.score_rows
        params = staged[torch.float32].reshape(3, R)
        params[:] = ((0.0,), (1.0,), (0.0,))  # greedy rows: temperature 0, top_p 1, draw 0
        top_k[:] = 0
        sampling = stage_sampling(batch, params, top_k)
        self._staging.upload({torch.int64: [(0, 2 * R + 5 * width)], torch.float32: [(0, 3 * R)]})
        return sampling

    _gather = True  # the next step's ids may come from `sampled` (set by `_stage`; other ranks: always)

    def _ids(self, width: int) -> torch.Tensor:
        """The step's token ids: staged, or gathered from the previous launch's sampled tokens."""
        if not self._gather:
            return self.input_ids(width)
        src = self.token_src(width)
        return torch.where(src >= 0, self.sampled.view(-1).index_select(0, src.clamp(min=0)), self.input_ids(width))

    def _forward(self, width: int, rows: int) -> torch.Tensor:
        """The captured region: ids, model forward over the static buffers, logits into `self.logits`."""
        out = self.model(self._ids(width), self.indexes(width), self.cache, self.logits_rows[:rows])
        self.logits[:rows].copy_(out)
        return self.logits

    def _padded(self, width: int, rows: int) -> int:  # a step's `rows`, padded as `pad_rows` says (one count a width)
        return min(self.rows, width) if self.pad_rows else rows

    def _trunk(self, width: int, rows: int) -> torch.Tensor:
        """The captured region of a chunked step: ids, the forward up to the final-normed hidden
        states of the logits rows [rows, H] (the graph's static output), no LM head."""
        return self.model.hidden_states(self._ids(width), self.indexes(width), self.cache, self.logits_rows[:rows])  # type: ignore[attr-defined]

    def execute(self, head: object, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Run `fn` eagerly, or replay its graph keyed by ((head, short step), generation, fingerprint)."""
        self.cache.short_hint = short = self.cache.short_step
        if self.graphs is None or self.adapters():
            if self.graphs is not None and len(self.graphs):
                self.graphs.retain(lambda key: False)
                self._bound = None
            return fn()
        bound = (self.cache.generation, self.fingerprint())
        if bound != self._bound:  # storage moved or the tree changed: older graphs never replay again
            self.graphs.retain(lambda key: key[1:] == bound)
            self._bound = bound
        if short and ((head, True), *bound) not in self.graphs and ((head, False), *bound) in self.graphs:
            self.cache.short_hint = short = False  # the long graph serves it (`warm`); the hint follows the key
        return self.graphs.run(((head, short), *bound), fn)  # type: ignore[return-value]

    def launch(self, batch: StepPlan, width: int, previous: SampledTokens | None = None) -> SampledTokens:
        """Queue the declared-and-prepared step at `width`: forward, sampling into a slot of
        `sampled`, and the copy of its tokens to the host. Returns the handle that reads them.

        The cache must have been given `begin_step(batch.seq_ids, width)` (or `declare_step` and
        `prepare_step`).
        `previous`: the launch whose tokens `batch.token_src` rows feed (it must not have been
        followed by another launch); this one takes the other slot, so a launch that raises
        leaves `previous`'s tokens in place for a retry. No host synchronisation on CUDA.
        """
        slot = 1 - previous.slot if previous is not None else 0
        sampling = self._stage(batch, width, previous)
        plan = self.logprob_slots.stage(batch) if batch.logprob_k else None
        rows = self._padded(width, batch.logits_rows)
        real = len(batch.rows)
        adjusts = any_adjusts(batch)
        # the host side of an adjusted step is rank 0's (its scheduler holds the matchers and histories)
        self._adjusting = (batch, previous) if adjusts else None
        try:
            if self.chunked and rows > HEAD_CHUNK:
                logprobs = self._chunked_launch(width, batch.logits_rows, real, sampling, slot, plan, adjusts)
            else:
                logits = self.role.run(
                    self._adjusted_step if adjusts else self._device_step, width, rows, real, sampling, slot
                )
                logprobs = None
                if plan is not None:  # rank 0's logits (every rank's are the same, gathered): its host reads them
                    logprobs = self.logprob_slots.launch(plan, logits, self.sampled[slot, :real], slot)
        finally:
            self._adjusting = None
        host = self._host_tokens[slot, :real]
        host.copy_(self.sampled[slot, :real], non_blocking=self._read[slot] is not None)
        event = self._read[slot]
        if event is not None:  # on the stream the copy ran on: the cache's device's
            event.record(torch.cuda.current_stream(self.cache.device))
        return SampledTokens(host, slot, event, logprobs)

    def _device_step(self, width: int, rows: int, real: int, sampling: bool, slot: int) -> torch.Tensor:
        """The step's device work from the staged inputs (the same on every tensor-parallel rank):
        the forward (eager or a graph) and sampling into `sampled[slot]`. No host wait. Returns
        the step's logits [rows, vocab]."""
        logits = self.execute(width, lambda: self._forward(width, rows))
        self.sampled[slot, :real].copy_(self._pick(logits[:real], 0, real, sampling))
        return logits

    _adjusting: tuple[StepPlan, SampledTokens | None] | None = None  # rank 0, during an adjusted step

    def _adjusted_step(self, width: int, rows: int, real: int, sampling: bool, slot: int) -> torch.Tensor:
        """`_device_step` for a step whose rows may adjust their logits (penalties, logit_bias,
        min_tokens: `batchkv.executor.penalties`; min_p) or be constrained
        (`batchkv.executor.constraints`). The forward is queued first; the host then stages the
        adjustments and fills the constrained rows' bitmask while the device runs it (waiting for
        the previous step's tokens only when a constrained row's newest token is among them). A step
        with none of them samples exactly as `_device_step`. Under tensor parallelism every rank
        runs the forward, rank 0 alone (`_adjusting`: its batch and previous launch) adjusts and
        samples, and the other ranks take its tokens (`role.share`), which later steps gather."""
        logits = self.execute(width, lambda: self._forward(width, rows))
        adjust = self._rank_adjuster(real, sampling, slot, logits.device)
        if adjust is not None:
            chosen, min_p = adjust(logits[:real], 0, real)
            self.sampled[slot, :real].copy_(self._pick(chosen, 0, real, sampling, min_p))
        self.role.share(self.sampled[slot, :real])
        return logits

    def _rank_adjuster(self, real: int, sampling: bool, slot: int, device: torch.device) -> Adjust | None:
        """This rank's part of an adjusted step: rank 0's adjuster (`_adjusting` holds its batch and
        previous launch), None on the other tensor-parallel ranks and in plain steps."""
        if self._adjusting is None:
            return None
        batch, previous = self._adjusting
        return self._adjuster(batch, real, sampling, slot, previous, device)

    def _adjuster(
        self, plan: StepPlan, real: int, sampling: bool, slot: int, previous: SampledTokens | None, device: torch.device
    ) -> Adjust:
        """`batchkv.executor.rows.adjuster` with this runner's bitmask buffers (made at the first
        constrained step) and the previous launch's tokens."""
        masks = None
        if self.grammars is not None and constrained(plan.samples):
            if self._masks is None:
                self._masks = MaskRows(self.rows, self.grammars.words, device)
            masks = self._masks
        last = self.sampled[previous.slot] if previous is not None else None
        return adjuster(plan, real, sampling, slot, previous, device, grammars=self.grammars, masks=masks, last=last)

    def _pick(
        self, chosen: torch.Tensor, lo: int, end: int, sampling: bool, min_p: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Tokens of sampling rows [lo, end) from their (adjusted) logits."""
        if not sampling:
            return greedy_tokens(chosen)
        at = slice(lo, end)
        return sample_tokens(chosen, self.temperature[at], self.top_k[at], self.top_p[at], self.draws[at], min_p)

    def _chunked_launch(
        self, width: int, rows: int, real: int, sampling: bool, slot: int, plan: LogprobPlan | None, adjusts: bool
    ) -> StepLogprobs | None:
        """A step of more than HEAD_CHUNK logits rows (see the module docstring): the trunk, then the
        head, sampling and logprobs chunk by chunk. Returns the step's logprobs handle, if asked."""
        self._scoring, self._parts = plan, []  # rank 0's logprob plan; followers keep None
        try:
            self.role.run(self._chunked_step, width, rows, real, sampling, slot, adjusts)
            return None if plan is None else self.logprob_slots.finish(plan, self._parts, slot)
        finally:
            self._scoring, self._parts = None, []

    def _chunked_step(self, width: int, rows: int, real: int, sampling: bool, slot: int, adjusts: bool = False) -> None:
        """The device work of a chunked step (the same on every tensor-parallel rank): the trunk (eager
        or a graph, over the rows the width pads to), then per chunk of `head_chunks(rows)` (the step's
        logits rows; the head runs eagerly: no padding row's logits) its float32 logits in `self.logits`,
        its sampling rows' tokens into `sampled[slot]` and, on rank 0, the logprobs of its rows that ask.
        A step that `adjusts` is adjusted and sampled by rank 0 alone (`_adjusting`, as
        `_adjusted_step`), whose tokens the other ranks then take (`role.share`). No host wait."""
        h = self.execute(width, lambda: self._trunk(width, self._padded(width, rows)))
        adjust = self._rank_adjuster(real, sampling, slot, h.device)
        with torch.no_grad():
            for lo, hi in head_chunks(rows):
                logits = self.logits[: hi - lo]
                logits.copy_(self.model.head(h[lo:hi]))  # type: ignore[attr-defined]
                end = min(hi, real)  # sampling rows come first, then prompt rows that score
                if lo < end and (adjust is not None or not adjusts):  # a follower of an adjusted step waits
                    chosen, min_p = logits[: end - lo], None
                    if adjust is not None:
                        chosen, min_p = adjust(chosen, lo, end)
                    self.sampled[slot, lo:end].copy_(self._pick(chosen, lo, end, sampling, min_p))
                if self._scoring is not None:
                    part = self.logprob_slots.part(self._scoring, logits, lo, hi, self.sampled[slot, :real])
                    if part is not None:
                        self._parts.append(part)
        if adjusts:
            self.role.share(self.sampled[slot, :real])

    def warm(self, widths: Sequence[int]) -> None:
        """Padding steps at each width (graphs captured, kernels compiled), in sequences made for them and
        removed after: one of prompt chunks, and first, where those are long and a decode step can take the
        width (up to the first width of `rows` tokens), a short one (wider short steps replay the long graph)."""
        share, decode = self.cache.config.max_write, min((w for w in widths if w >= self.rows), default=self.max_width)
        for width in widths:
            for tokens in (1, width) if min(share, width) > SHORT_RUN and width <= decode else (width,):
                seqs: list[int] = []
                try:
                    batch = StepPlan(rows=[tokens - 1])
                    for start in range(0, tokens, share):
                        n = min(share, tokens - start)
                        seqs.append(self.cache.seq_new(reach=n))
                        batch.add(seqs[-1], [0] * n, list(range(n)))
                    self.cache.begin_step(batch.seq_ids, width)
                    self.role.read(self.launch(batch, width))  # bounded under tensor parallelism
                finally:
                    for seq in seqs:
                        self.cache.seq_rm(seq)

    def run(self, batch: StepPlan, width: int) -> list[list[int]]:
        """`launch` and read at once: each row's token as a one-token list (as a verify step's accepted runs)."""
        return self.launch(batch, width).read()
