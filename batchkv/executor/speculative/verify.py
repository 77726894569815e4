"""The verify runner: one forward over a step whose sampling rows are verify segments, with
acceptance on the device and one small host read.

Static device buffers, sized at the largest width W: token ids [W], RoPE indexes [3, W], the draft
source of each packed row [W] (-1: the staged id; else an index into the proposer's device draft
buffer, so DFlash drafts never visit the host), and per logits row (at most W): the packed row,
whether a draft follows it in its segment, the segment table (start, length), and the sampling
parameters and two uniform draws. The result is int64 [W, block + 1] (see `acceptance.combine`).

Logits rows per step: at most 64 anchors (the scheduler's cap on sampling rows) times block_size.
The LM head runs on them in row chunks: greedy steps take the argmax of chunks of 256 rows in the
model's dtype (each chunk reads the head's weights once: at 32 sequences x 8 rows that is one read,
not four); sampling steps turn 64 rows at a time into float32 probabilities. So a step never holds
more than a [64, vocab] float32 tensor or a [256, vocab] model-dtype one, however many rows it
verifies.

With a `GraphSet`, the forward, the head and the acceptance are one graph per (width bucket,
logits-rows bucket, sampling or greedy) and storage generation and module tree. A step with a
constrained sample (`batchkv.executor.constraints`) stages one bitmask row per logits row (a
segment's row j as its matcher allows after the first j drafts) and replays a graph of its own that
masks the logits from the fixed-address bitmask buffer; other steps replay the unmasked one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from batchkv.cache import BatchedSequenceCache
from batchkv.cache.staging import NamedStaging
from batchkv.errors import StepError
from batchkv.executor.constraints import MaskRows, allowed, constrained
from batchkv.executor.graphs import GraphSet
from batchkv.executor.penalties import Penalties, stage_verify_penalties
from batchkv.executor.request import StepModel
from batchkv.executor.roles import LOCAL, Role
from batchkv.executor.runner import ModelRunner
from batchkv.executor.sampling import uniform
from batchkv.executor.scheduler import StepPlan
from batchkv.executor.speculative.acceptance import combine, greedy_rows, sampled_rows

HEAD_CHUNK = 64  # logits rows per LM-head call of a sampling step: bounds the float32 [rows, vocab] it holds
GREEDY_HEAD_CHUNK = 256  # of a greedy step (model dtype; [256, 151936] bf16 is 78 MB)
ACCEPT_STREAM = 1  # `uniform` stream of the acceptance test (stream 0 draws tokens)

# int64 buffers: name -> length in units of W (carved once, by name)
_I64 = (("ids", 1), ("indexes", 3), ("draft_src", 1), ("rows", 1), ("has_next", 1), ("seg_start", 1),
        ("seg_len", 1), ("top_k", 1))  # fmt: skip
_F32 = ("temperature", "top_p", "u_accept", "u_draw")


class VerifyRunner(ModelRunner):
    """Runs planned steps whose sampling rows form segments (`StepPlan.spans`) and returns, per
    segment, the tokens it emits: accepted drafts then the correction or bonus token.

    model: the engine's model, with `hidden_states(input_ids, indexes, cache, rows, taps=None)
    -> [R, H]` (final-normed hidden states of the selected rows) and `head(h) -> [R, vocab]` in
    its dtype. buckets: the engine's width buckets (logits rows are padded to one of them).
    drafts: the proposer's device draft buffer (int64), or None when drafts come as token ids.
    taps: a `HiddenTaps`-like object whose `bind(width)` gives the taps a forward of that width
    writes (DFlash context features), or None.
    """

    def __init__(
        self,
        model: StepModel,
        cache: BatchedSequenceCache,
        buckets: tuple[int, ...],
        block_size: int,
        *,
        graphs: GraphSet | None = None,
        drafts: torch.Tensor | None = None,
        taps: object | None = None,
        role: Role = LOCAL,
    ) -> None:
        w = buckets[-1]
        self._bind(model, cache, w, graphs)
        self.buckets, self.block_size, self.drafts, self.taps = buckets, block_size, drafts, taps
        self.pad_rows = True
        self.rows = w  # logits rows a step may take: every token of a verify step (`warm`'s short widths)
        layout = {name: (torch.int64, n * w) for name, n in _I64} | {name: (torch.float32, w) for name in _F32}
        self._staging = NamedStaging(layout, cache.device)
        self.buf: dict[str, torch.Tensor] = self._staging.buf
        self.result = torch.zeros(w, block_size + 1, dtype=torch.int64, device=cache.device)
        self.grammars = None  # `Engine.use_tokenizer`: constrained decoding
        self._masks: MaskRows | None = None  # its bitmask rows, made at the first constrained step
        self.role = role
        role.bind(self, self._staging)

    def input_ids(self, width: int) -> torch.Tensor:
        return self.buf["ids"][:width]

    def indexes(self, width: int) -> torch.Tensor:
        return self.buf["indexes"][: 3 * width].view(3, width)

    def _rows_bucket(self, rows: int) -> int:
        return next(b for b in self.buckets if b >= rows)

    def _stage(self, batch: StepPlan, width: int, rows: int) -> bool:  # type: ignore[override]
        """Write the step's inputs to the device buffers; True when some row samples (not greedy)."""
        host = self._staging.begin_named()
        n = len(batch.input_ids)
        ids, index = host["ids"], host["indexes"][: 3 * width].reshape(3, width)
        ids[:width] = 0  # padding feeds token 0; its K/V go to the scratch column
        ids[:n] = batch.input_ids
        index[:] = 0  # text tokens: (t, 0, 0)
        index[0, :n] = batch.t_index
        src = host["draft_src"]
        src[:width] = -1
        if batch.draft_src:
            src[:n] = batch.draft_src
        for name in ("rows", "has_next", "seg_start", "seg_len", "top_k"):
            host[name][:rows] = 0
        for name, fill in (("temperature", 0.0), ("top_p", 1.0), ("u_accept", 0.0), ("u_draw", 0.0)):
            host[name][:rows] = fill
        real = len(batch.rows)
        host["rows"][:real] = batch.rows
        sampling, r = False, 0
        for i, (sample, span) in enumerate(zip(batch.samples, batch.spans, strict=True)):
            host["seg_start"][i], host["seg_len"][i] = r, span
            host["has_next"][r : r + span - 1] = 1
            p = sample.owner.request.params
            if not p.greedy:
                sampling = True
                host["temperature"][r : r + span] = p.temperature
                host["top_p"][r : r + span] = p.top_p
                host["top_k"][r : r + span] = p.top_k
                seed, index, emitted = sample.owner.seed, sample.index, len(sample.tokens)
                for j in range(span):  # row j decides output token `emitted + j`
                    host["u_draw"][r + j] = uniform(seed, index, emitted + j)
                    host["u_accept"][r + j] = uniform(seed, index, emitted + j, ACCEPT_STREAM)
            r += span
        self._staging.upload()
        return sampling

    def _forward(  # type: ignore[override]
        self, width: int, rows: int, sampling: bool, masked: bool = False, adjust: Adjustments | None = None
    ) -> torch.Tensor:
        """The captured region: forward, LM head in row chunks, acceptance; writes `self.result`.
        `adjust` (eager steps only): per-chunk penalties and per-row min_p (`_adjusted_step`)."""
        b = self.buf
        ids = self.input_ids(width)
        if self.drafts is not None:  # drafts produced on the device replace their placeholder ids
            src = b["draft_src"][:width]
            ids = torch.where(src >= 0, self.drafts.index_select(0, src.clamp(min=0)), ids)
        select = b["rows"][:rows]
        taps = self.taps.bind(width) if self.taps is not None else None  # type: ignore[attr-defined]
        h = self.model.hidden_states(ids, self.indexes(width), self.cache, select, taps=taps)  # type: ignore[attr-defined]
        following = ids.index_select(0, (select + 1).clamp(max=width - 1))
        draft_next = torch.where(b["has_next"][:rows] > 0, following, -1)
        oks, fixes = [], []
        chunk = HEAD_CHUNK if sampling else GREEDY_HEAD_CHUNK
        for c in range(0, rows, chunk):
            part = slice(c, min(rows, c + chunk))
            logits = self.model.head(h[part])  # type: ignore[attr-defined]  # [chunk, vocab], model dtype
            if adjust is not None and c in adjust.penalties:
                logits = adjust.penalties[c].apply(logits.float(), None)
            # Constrained rows: the fixed-address bitmask buffer (a graph of its own). Only rank 0
            # holds one: the other ranks' acceptance is never read (rank 0 plans from its own).
            if masked and self._masks is not None:
                keep = allowed(self._masks.device[part], logits.shape[-1])  # type: ignore[union-attr]
                logits = logits.masked_fill(~keep, float("-inf"))
            if sampling:
                params = (b[name][part] for name in ("temperature", "top_k", "top_p", "u_accept", "u_draw"))
                min_p = adjust.min_p[part] if adjust is not None and adjust.min_p is not None else None
                ok, fix = sampled_rows(logits.float(), draft_next[part], *params, min_p=min_p)
            else:
                ok, fix = greedy_rows(logits, draft_next[part])
            oks.append(ok)
            fixes.append(fix)
        out = combine(torch.cat(oks), torch.cat(fixes), draft_next, b["seg_start"][:rows], b["seg_len"][:rows],
                      self.block_size)  # fmt: skip
        self.result[:rows].copy_(out)
        return self.result

    def launch(self, batch: StepPlan, width: int, previous: object | None = None) -> AcceptedRuns:  # type: ignore[override]
        """Queue the declared-and-prepared step at `width` with acceptance on the device; the
        returned handle reads each segment's emitted tokens. The cache must be declared and
        prepared. Speculating engines plan from accepted counts, so they never overlap steps:
        every id is staged from the host (`previous` must be None)."""
        if previous is not None or batch.token_src:
            raise StepError("a verify step reads its tokens on the host before the next plan; run it without overlap")
        rows = self._rows_bucket(len(batch.rows))
        sampling = self._stage(batch, width, rows)
        masked = self.grammars is not None and constrained(batch.samples)
        if masked:
            self._stage_masks(batch, rows)
        if any(s.owner.request.params.adjusts_logits or s.owner.request.params.min_p > 0 for s in batch.samples):
            self._adjusting = self._stage_adjustments(batch, rows, sampling)
            try:
                result = self.role.run(self._adjusted_step, width, rows, sampling, masked)
            finally:
                self._adjusting = None
        elif masked:
            result = self.role.run(self._device_step, width, rows, sampling, True)
        else:
            result = self.role.run(self._device_step, width, rows, sampling)
        return AcceptedRuns(result[: len(batch.samples)])

    _adjusting: Adjustments | None = None  # rank 0, during an adjusted verify step

    def _stage_adjustments(self, batch: StepPlan, rows: int, sampling: bool) -> Adjustments:
        """Penalties of each LM-head chunk (row j of a segment counting the first j drafts as
        output, `stage_verify_penalties`) and, when a sampled row asks, min_p per logits row."""
        device = self.cache.device
        chunk = HEAD_CHUNK if sampling else GREEDY_HEAD_CHUNK
        min_p = None
        if sampling and any(s.owner.request.params.min_p > 0 for s in batch.samples):
            values = [0.0] * rows
            r = 0
            for sample, span in zip(batch.samples, batch.spans, strict=True):
                values[r : r + span] = [sample.owner.request.params.min_p] * span
                r += span
            min_p = torch.tensor(values, dtype=torch.float32).to(device)
        return Adjustments(stage_verify_penalties(batch, chunk, device), min_p)

    def _adjusted_step(self, width: int, rows: int, sampling: bool, masked: bool) -> torch.Tensor:
        """`_device_step` for a step with penalties or min_p, eager (their lists change shape every
        step). Every rank runs the forward; rank 0 alone adjusts (`_adjusting`): the other ranks'
        acceptance is never read, rank 0 plans from its own."""
        return self._forward(width, rows, sampling, masked, self._adjusting)

    def _stage_masks(self, batch: StepPlan, rows: int) -> None:
        """Fill and upload the bitmask of every logits row: row j of a constrained sample's segment
        allows what its matcher allows after the segment's first j drafts (looked at and rolled
        back: the matcher only advances on accepted tokens); every other row allows everything."""
        grammars = self.grammars
        assert grammars is not None
        if self._masks is None:
            self._masks = MaskRows(self.max_width, grammars.words, self.cache.device)
        host = self._masks.host[0]
        host[:rows] = -1
        r = 0
        for sample, span in zip(batch.samples, batch.spans, strict=True):
            if sample.owner.grammar is not None:
                if sample.matcher is None:
                    stops = sample.owner.request.params.stop_token_ids
                    sample.matcher = grammars.matcher(sample.owner.grammar, stops)
                drafts = [batch.input_ids[batch.rows[r + j]] for j in range(1, span)]
                for j in range(span):
                    grammars.fill(sample.matcher, host, r + j, drafts[:j])
            r += span
        self._masks.upload(0, rows)

    def _device_step(self, width: int, rows: int, sampling: bool, masked: bool = False) -> torch.Tensor:  # type: ignore[override]
        """The step's device work from the staged inputs (the same on every tensor-parallel rank).
        `masked`: apply the staged bitmask rows (constrained samples) before acceptance."""
        fn: Callable[[], torch.Tensor] = lambda: self._forward(width, rows, sampling, masked)  # noqa: E731
        return self.execute((width, rows, sampling, masked) if masked else (width, rows, sampling), fn)


@dataclass
class Adjustments:
    """A verify step's logit adjustments on the device: `Penalties` per LM-head chunk (keyed by
    its first row) and min_p float32 [rows] (None: no sampled row asks)."""

    penalties: dict[int, Penalties]
    min_p: torch.Tensor | None


class AcceptedRuns:
    """A launched verify step's result table on the device, int64 [segments, block + 1]."""

    slot = 0
    event = None  # read() waits on the stream (a speculating engine never has a step queued behind)

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table

    def read(self) -> list[list[int]]:
        """Each segment's emitted tokens (accepted drafts, then the correction or bonus)."""
        table = self.table.tolist()  # the step's one host synchronisation
        return [row[1 : 1 + row[0]] for row in table]

    def logprobs(self) -> None:
        """None: a speculating engine refuses requests that ask for logprobs (`Engine.submit`)."""
        return None
