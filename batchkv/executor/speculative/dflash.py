"""The DFlash proposer: a `DFlashDrafter` drafting every speculating sample's block in one forward.

Per engine step, before the target's step is declared (`propose`), one drafter step over the
drafter's own cache: per owner one non-causal segment `[context rows..., anchor, mask x k]` (k = 0:
context rows only; a step where no sample drafts runs `DFlashDrafter.write_context`, which stops
at the context rows' K/V: no queries, MLPs or LM head; at the 8B shape 7% of the bytes a drafting
step reads). The context rows are the positions the target committed since the owner's last draft; their features
are the target's hidden states after the drafter's `target_layer_ids`, tapped by the previous
target step (`HiddenTaps`, rows selected inside the forward) and gathered on the device. The
drafts (argmax of the target's LM head over the block's mask rows) stay on the device: the verify
runner reads them through `StepPlan.draft_src`. After the step every owner is rewound to its committed
length, so only context K/V stay. After the target's step (`observe`) each owner's accepted rows
(anchor + accepted drafts, or a prompt chunk) become its next context rows.

Forks (n > 1): the prompt's context goes to sample 0's drafter column; the other samples decode
plainly for one step, and their drafter columns are cloned from sample 0's right after the drafter
step that wrote the prompt's last chunk. Drafts are each row's argmax (a point-mass proposal) for
greedy and sampled requests alike; acceptance keeps sampling lossless (see `acceptance.py`).

Drafter widths: the context rows of one step are at most the previous target step's rows, plus a
block per anchor (at most 64), so the drafter's widest step is the target's widest plus
min(64, max_seqs) * block_size; `max_write` is max(prefill_chunk, block_size) + block_size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from batchkv.cache import BatchedSequenceCache, CacheConfig
from batchkv.cache.staging import NamedStaging
from batchkv.errors import ConfigError, StepError
from batchkv.executor.graphs import GraphSet
from batchkv.executor.runner import ModelFingerprint, ModelRunner
from batchkv.executor.scheduler import SampleState, StepPlan
from batchkv.executor.sizing import default_buckets
from batchkv.executor.speculative.config import MAX_SPECULATIVE_ROWS, SpeculativeConfig
from batchkv.executor.speculative.speculator import Drafts

if TYPE_CHECKING:
    from batchkv.executor.roles import Role

HEAD_CHUNK = 256  # draft rows per LM-head call (argmax in the model dtype; each call reads the head once)


@dataclass(eq=False)
class DraftState:
    """One sample's drafter column and its context rows not yet written there (packed rows of the
    last target step, at positions [pos(seq), pos(seq) + len(pending)))."""

    seq: int
    pending: list[int] = field(default_factory=list)


class _Modules:
    """The drafter and the target's modules, so one fingerprint covers both (a drafter graph
    embeds with the target's table and drafts with its LM head)."""

    def __init__(self, drafter: nn.Module, target: object) -> None:
        self.drafter = drafter
        for name, module in ModelFingerprint(target).modules():  # type: ignore[arg-type]
            setattr(self, f"target_{name or 'model'}", module)


class DraftRunner(ModelRunner):
    """Graph binding of the drafter's step (the buffers live on the proposer)."""

    def __init__(self, modules: _Modules, cache: BatchedSequenceCache, width: int, graphs: GraphSet | None) -> None:
        self._bind(modules, cache, width, graphs)  # type: ignore[arg-type]


class DFlashProposer:
    """Drafts with a `DFlashDrafter` for an engine (see the module docstring)."""

    def __init__(
        self,
        config: SpeculativeConfig,
        target: object,
        graphs: GraphSet | None,
        *,
        cache: BatchedSequenceCache,
        buckets: Sequence[int],
        prefill_chunk: int,
        role: Role,
    ) -> None:
        """The drafter (built from `config.drafter` when that is a factory) drafting for `target`,
        whose engine has `cache`, width `buckets`, `prefill_chunk` and tensor-parallel `role`."""
        drafter = config.drafter
        if not isinstance(drafter, nn.Module):  # a factory(target) (tensor parallelism: one per rank)
            drafter = drafter(target)  # type: ignore[operator]
        if not callable(getattr(target, "embed", None)):
            raise ConfigError(
                f"a DFlash drafter embeds with the target's table; {type(target).__name__} has no embed()"
            )
        if getattr(drafter, "target", None) is not target:
            raise ConfigError("the drafter was built for another model; build_drafter(target=<the engine's model>)")
        block = config.block_size
        self.drafter, self.target, self.block = drafter, target, block
        anchors = min(MAX_SPECULATIVE_ROWS, cache.max_seqs)
        self.buckets = default_buckets(buckets[-1] + anchors * block)
        width = self.buckets[-1]
        max_write = min(cache.capacity, max(prefill_chunk, block) + block)
        spec = drafter.cache_spec()  # type: ignore[attr-defined]
        self.role = role
        self.cache = self.role.cache(
            CacheConfig(**spec, max_seqs=cache.max_seqs, capacity=cache.capacity, max_write=max_write, max_width=width),
            cache.device,
            attention=cache.attention,
        )
        self.target_cache = cache
        self.taps = drafter.make_taps(buckets[-1])  # type: ignore[attr-defined]
        device = cache.device
        names = ("ids", "t", "is_ctx", "gather", "rows")
        self._staging = NamedStaging({name: (torch.int64, width) for name in names}, device)
        self.buf = self._staging.buf
        self.drafts = torch.zeros(width, dtype=torch.int64, device=device)  # device draft buffer
        # keyed by the drafter's widths; the role says how a capture treats other threads' CUDA calls
        own_graphs = GraphSet(device, capture_error_mode=self.role.capture_error_mode) if graphs is not None else None
        self.runner = DraftRunner(_Modules(drafter, target), self.cache, width, own_graphs)  # type: ignore[arg-type]
        self.states: dict[SampleState, DraftState] = {}
        self.fork_from: dict[SampleState, SampleState] = {}  # fork -> sample 0 whose column it clones
        self.role.bind(self, self._staging)

    def sequences(self) -> list[int]:
        return self.cache.sequences

    # ---- before the target's step ---------------------------------------------------------------
    def propose(self, batch: StepPlan, samples: list[SampleState], counts: list[int]) -> Drafts:
        """Run the drafter step: flush every owner's context rows and draft the decode samples' blocks."""
        want = {s: k for s, k in zip(samples, counts, strict=True) if k > 0 and s in self.states}
        segments = [(s, st, want.get(s, 0)) for s, st in self.states.items() if st.pending or s in want]
        src: dict[SampleState, list[int]] = {}
        if segments:
            src = self._draft(segments)
        self._sync_forks()
        self.release()
        tokens = [[0] * len(src.get(s, ())) for s in samples]
        return Drafts(tokens, [src.get(s, []) for s in samples])

    def _draft(self, segments: list[tuple[SampleState, DraftState, int]]) -> dict[SampleState, list[int]]:
        h = self._staging.begin_named()  # waits until the last upload has left the pinned buffers
        mask = self.drafter.config.mask_token_id  # type: ignore[attr-defined]
        seq_ids: list[int] = []
        n = r = 0
        src: dict[SampleState, list[int]] = {}
        for sample, st, k in segments:
            start = self.cache.pos(st.seq)
            offset = sample.owner.request.rope_offset
            ctx, total = len(st.pending), len(st.pending) + (k + 1 if k else 0)
            if k and self.target_cache.pos(sample.seq) != start + ctx:
                raise StepError(f"drafter column of sample {sample.index} of request {sample.owner.id} is out of step")
            h["ids"][n : n + total] = 0
            h["is_ctx"][n : n + total] = 0
            h["is_ctx"][n : n + ctx] = 1
            h["gather"][n : n + total] = 0
            h["gather"][n : n + ctx] = st.pending
            h["t"][n : n + total] = range(offset + start, offset + start + total)
            if k:
                h["ids"][n + ctx] = sample.tokens[-1]  # the anchor, then mask tokens
                h["ids"][n + ctx + 1 : n + total] = mask
                h["rows"][r : r + k] = range(n + ctx + 1, n + total)
                src[sample] = list(range(r, r + k))
                r += k
            seq_ids += [st.seq] * total
            n += total
        width = next(b for b in self.buckets if b >= n)
        rows = next(b for b in self.buckets if b >= max(r, 1))
        h["ids"][n:width] = 0
        h["is_ctx"][n:width] = 0
        h["gather"][n:width] = 0
        h["t"][n:width] = 0
        h["rows"][r:rows] = 0
        self._staging.upload()
        self.cache.begin_step(seq_ids, width)
        self.role.run(self._device_step, width, rows if r else 0)
        self.cache.commit_step()
        for _, st, k in segments:
            if k:
                self.cache.rewind(st.seq, self.cache.pos(st.seq) - k - 1)  # only context K/V stay
            st.pending = []
        return src

    def _device_step(self, width: int, rows: int) -> None:
        """The drafter step's device work (the same on every tensor-parallel rank); rows 0: nobody
        drafts, so only the context rows' K/V are written (no layer past them, no LM head)."""
        if rows:
            self.runner.execute((width, rows), lambda: self._forward(width, rows))
        else:
            self.runner.execute((width, 0), lambda: self._write_context(width))

    def _forward(self, width: int, rows: int) -> torch.Tensor:
        """The captured region: gather context features, the drafter forward, argmax drafts."""
        b = self.buf
        features = self.taps.out.index_select(0, b["gather"][:width])
        h = self.drafter(b["ids"][:width], features, b["is_ctx"][:width] > 0, b["t"][:width], self.cache,  # type: ignore[operator]
                         b["rows"][:rows])  # fmt: skip
        for c in range(0, rows, HEAD_CHUNK):
            part = slice(c, min(rows, c + HEAD_CHUNK))
            self.drafts[part].copy_(self.target.head(h[part]).argmax(-1))  # type: ignore[attr-defined]
        return self.drafts

    def _write_context(self, width: int) -> torch.Tensor:
        """The captured region of a step without blocks: gather context features, write their K/V."""
        b = self.buf
        features = self.taps.out.index_select(0, b["gather"][:width])
        self.drafter.write_context(features, b["t"][:width], self.cache)  # type: ignore[attr-defined]
        return self.drafts

    def _sync_forks(self) -> None:
        """Clone sample 0's drafter column for forks once it holds the whole prompt."""
        for fork, parent in list(self.fork_from.items()):
            st = self.states.get(parent)
            if fork.finish is None and st is not None and not st.pending:
                self.states[fork] = DraftState(self.cache.seq_clone(st.seq))
            if fork.finish is not None or st is None or not st.pending:
                del self.fork_from[fork]

    # ---- after the target's step ----------------------------------------------------------------
    def observe(self, batch: StepPlan, runs: list[list[int]]) -> None:
        """Accepted rows (and prompt chunks) of the committed step become context to write next."""
        r = end = 0
        for sample, span, run in zip(batch.samples, batch.spans, runs, strict=True):
            if sample.tokens:  # a decode or verify segment (prompt rows come after)
                st = self.states.get(sample)
                if st is not None:
                    st.pending = batch.rows[r : r + len(run)]
                end = max(end, batch.rows[r + span - 1] + 1)
            r += span
        for state, chunk in batch.prefill:
            head = state.samples[0]
            st = self.states.get(head)
            if st is None:  # as far as the target's column, and a block past it (drafts are rewound)
                reach = min(self.cache.capacity, self.target_cache.reach(head.seq) + self.block)
                st = self.states[head] = DraftState(self.cache.seq_new(reach=reach))
            st.pending = list(range(end, end + chunk))
            end += chunk
        for state in batch.completed:
            for fork in state.samples[1:]:
                self.fork_from[fork] = state.samples[0]

    def release(self) -> None:
        """Free drafter columns of finished samples (kept while a fork still needs to clone one)."""
        needed = {parent for fork, parent in self.fork_from.items() if fork.finish is None}
        for sample in [s for s, st in self.states.items() if s.finish is not None and s not in needed]:
            self.cache.seq_rm(self.states.pop(sample).seq)
