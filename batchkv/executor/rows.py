"""A step's logits rows past the forward: the LM head's row chunks, and the per-row logit
adjustments of a range of sampling rows (`batchkv.executor.runner` runs both).

Past HEAD_CHUNK logits rows a runner makes the float32 logits [chunk, vocab] one chunk at a time
(`head_chunks`: even chunks, as few as HEAD_CHUNK allows) from the final-normed hidden states, for a
model that exposes `hidden_states` and `head` (`chunkable`). `adjuster` prepares one step's
adjustments (the constrained rows' bitmask filled and uploaded at once, min_p staged) and returns
the function that applies them to the logits of sampling rows [lo, end): that range's penalties
(`batchkv.executor.penalties`, staged per range), the bitmask rows and min_p. Over all the rows at
once it does what the runner did before chunks existed, in the same order on the device.
`stage_sampling` stages the sampling rows' parameters and draws from the scheduler's slot table.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import numpy as np
import torch

from batchkv.executor.constraints import Grammars, MaskRows, allowed, fill_step
from batchkv.executor.penalties import stage_penalties
from batchkv.executor.sampling import uniform, uniforms
from batchkv.executor.state import StepPlan

HEAD_CHUNK = 256  # most logits rows one LM-head call makes: past it a step's head runs in chunks


def head_chunks(rows: int, chunk: int = HEAD_CHUNK) -> list[tuple[int, int]]:
    """Row ranges [lo, hi) of equal size (the last may be smaller) covering [0, rows), each at most
    `chunk` rows and as few as that allows: 320 rows are two chunks of 160, not 256 + 64 (so every
    chunk of a chunked step takes the same many-row matmul path)."""
    count = -(-rows // chunk)
    size = -(-rows // count) if rows else 1
    return [(lo, min(rows, lo + size)) for lo in range(0, rows, size)]


def chunkable(model: object) -> bool:
    """True when `model` exposes the final hidden states and LM head the chunked head needs."""
    return all(callable(getattr(model, name, None)) for name in ("hidden_states", "head"))


def any_adjusts(batch: StepPlan) -> bool:
    """True when a sampling row of `batch` adjusts its logits or is constrained (`adjusts_sampling`):
    one array read of the scheduler's `SlotTable`, or row by row for a plan without one."""
    if batch.table is not None:
        return bool(batch.table.adjusts[batch.slots].any())
    return any(sample.owner.request.params.adjusts_sampling for sample in batch.samples)


def stage_sampling(batch: StepPlan, params: np.ndarray, top_k: np.ndarray) -> bool:
    """Each sampling row's temperature, top_p and draw (`params` [3, R]) and top_k, for rows
    that sample (greedy rows keep 0, 1, 0 and 0); True when one does. Array work over the
    scheduler's `SlotTable` columns (`batch.table`); row by row for a plan without one."""
    table = batch.table
    if table is None:
        sampling = False
        for i, sample in enumerate(batch.samples):
            p = sample.owner.request.params
            if not p.greedy:
                sampling = True
                params[:, i] = (p.temperature, p.top_p, uniform(sample.owner.seed, sample.index, sample.count))
                top_k[i] = p.top_k
        return sampling
    slots = batch.slots
    rows = np.flatnonzero(~table.greedy[slots])
    if not len(rows):
        return False
    at = slots[rows]
    params[0, rows], params[1, rows], top_k[rows] = table.temperature[at], table.top_p[at], table.top_k[at]
    params[2, rows] = uniforms(table.seed[at], table.index[at], table.read[at] + table.pending[at])
    return True


Adjust = Callable[[torch.Tensor, int, int], tuple[torch.Tensor, torch.Tensor | None]]


def adjuster(
    batch: StepPlan,
    real: int,
    sampling: bool,
    slot: int,
    previous,
    device: torch.device,
    *,
    grammars: Grammars | None,
    masks: MaskRows | None,
    last: torch.Tensor | None,
) -> Adjust:
    """Fill host slot `slot` of `masks` (when some row is constrained: `masks` not None) for the
    step's `real` sampling rows and upload it (host work while the forward runs; reading
    `previous`, the launch before, only when a constrained row's newest token is among its
    tokens); stage min_p when `sampling`. Returns adjust(logits of sampling rows [lo, end), lo, end)
    -> (adjusted logits, their min_p or None), which stages those rows' penalties (`last`: the
    previous launch's sampled tokens on the device) and applies them and the mask."""
    if masks is not None:
        assert grammars is not None
        host = masks.host[slot]
        runs: list[list[int]] | None = None

        def ahead(i: int) -> list[int]:
            nonlocal runs
            if not batch.samples[i].pending:
                return []
            if runs is None:  # the previous step's tokens: the device has queued this forward after it
                runs = previous.read() if previous is not None else []
            return runs[batch.token_src[i]]

        fill_step(grammars, batch.samples, host, ahead)
        masks.upload(slot, real)
    min_p = None
    if sampling and any(s.owner.request.params.min_p > 0 for s in batch.samples):
        values = [s.owner.request.params.min_p for s in batch.samples]
        min_p = torch.tensor(values, dtype=torch.float32).to(device)

    def adjust(chosen: torch.Tensor, lo: int, end: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        rows = batch if (lo, end) == (0, real) else _rows_of(batch, lo, end)
        penalties = stage_penalties(rows, device)  # type: ignore[arg-type]
        if penalties is not None:
            chosen = penalties.apply(chosen, last)
        if masks is not None:
            chosen = chosen.masked_fill(~allowed(masks.device[lo:end], chosen.shape[1]), float("-inf"))
        return chosen, None if min_p is None else min_p[lo:end]

    return adjust


def _rows_of(batch: StepPlan, lo: int, end: int) -> SimpleNamespace:
    """Sampling rows [lo, end) of `batch` as `stage_penalties` reads a batch (samples, token_src)."""
    return SimpleNamespace(samples=batch.samples[lo:end], token_src=batch.token_src[lo:end] if batch.token_src else [])
