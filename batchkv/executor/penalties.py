"""Per-row logit adjustments on the device: logit_bias, min_tokens, repetition, frequency and
presence penalties (`SamplingParams`), applied to a step's sampling rows before they sample.

Only steps with a row that asks run any of this (`stage_penalties` returns None otherwise, and the
runner then samples exactly as before). For the m rows that ask, the host stages sparse lists
(pinned, copied without waiting): each row's prompt tokens, its output tokens read so far, the
stop ids it may not sample yet (min_tokens) and its logit_bias entries. A decode row whose newest
token is still on the device (overlap) gathers it from the previous launch's sampled tokens, as the
forward does. On the device, for those rows only:

    counts[m, V] = occurrences of each token in the output (scatter-add)
    logits += bias; logits[stop ids before min_tokens] = -inf
    seen = counts > 0 or in the prompt
    logits = where(seen, logits / rp if logits > 0 else logits * rp, logits)
    logits -= frequency * counts + presence * (counts > 0)

which is vLLM's order (logits processors, then penalties) and transformers' meaning of the
repetition penalty (prompt and output tokens). The result is a new tensor: the step's logits,
which logprobs read, stay raw. Static shapes given the lists, no host reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from batchkv.executor.request import SamplingParams
from batchkv.executor.state import StepPlan


@dataclass
class Penalties:
    """One step's adjustments, on the device: per asking row its sampling row and parameters, and
    the sparse (row, token[, value]) lists; `pending` rows take their newest token from the
    previous launch's sampled tokens (row index into that slot)."""

    rows: torch.Tensor  # int64 [m]: sampling rows that ask
    repetition: torch.Tensor  # float32 [m]
    frequency: torch.Tensor  # float32 [m]
    presence: torch.Tensor  # float32 [m]
    output: torch.Tensor  # int64 [2, a]: (row among m, token) per output token read
    prompt: torch.Tensor  # int64 [2, b]: (row, token) per prompt token
    pending: torch.Tensor  # int64 [2, c]: (row, row of the previous launch's tokens)
    banned: torch.Tensor  # int64 [2, d]: (row, stop id) below min_tokens
    bias_at: torch.Tensor  # int64 [2, e]: (row, token)
    bias: torch.Tensor  # float32 [e]

    def apply(self, logits: torch.Tensor, previous: torch.Tensor | None) -> torch.Tensor:
        """`logits` (float32 [rows, V], the step's sampling rows) with the adjustments applied, as a
        new tensor. `previous`: int64 [R], the previous launch's sampled tokens (None without)."""
        m, vocab = self.rows.numel(), logits.shape[-1]
        sel = logits.index_select(0, self.rows)
        counts = torch.zeros(m, vocab, dtype=torch.float32, device=logits.device)
        ones = torch.ones(self.output.shape[1], dtype=torch.float32, device=logits.device)
        counts.index_put_((self.output[0], self.output[1]), ones, accumulate=True)
        if self.pending.shape[1] and previous is not None:
            newest = previous.index_select(0, self.pending[1])
            counts.index_put_((self.pending[0], newest), torch.ones_like(newest, dtype=torch.float32), accumulate=True)
        sel = sel.index_put((self.bias_at[0], self.bias_at[1]), self.bias, accumulate=True)
        sel = sel.index_put((self.banned[0], self.banned[1]), torch.tensor(float("-inf"), device=logits.device))
        seen = counts > 0
        seen = seen.index_put((self.prompt[0], self.prompt[1]), torch.tensor(True, device=logits.device))
        rp = self.repetition[:, None]
        sel = torch.where(seen, torch.where(sel > 0, sel / rp, sel * rp), sel)
        sel = sel - self.frequency[:, None] * counts - self.presence[:, None] * (counts > 0).float()
        return logits.index_copy(0, self.rows, sel)


@dataclass(frozen=True)
class RowHistory:
    """What one logits row's adjustments read: its sampling parameters, the output tokens before
    the token it decides (read by the host), its prompt, and `pending`: the row of the previous
    launch's sampled tokens that holds one more output token still on the device (or None)."""

    row: int
    params: SamplingParams
    output: Sequence[int]
    prompt: Sequence[int]
    pending: int | None = None


def stage_penalties(batch: StepPlan, device: torch.device) -> Penalties | None:
    """The adjustments of `batch`'s sampling rows that ask (`SamplingParams.adjusts_logits`), staged
    to `device`; None when no row asks (the step then runs none of this)."""
    rows = [
        RowHistory(i, s.owner.request.params, s.tokens, s.owner.prompt, batch.token_src[i] if s.pending else None)
        for i, s in enumerate(batch.samples)
        if s.owner.request.params.adjusts_logits
    ]
    return stage_rows(rows, device) if rows else None


def stage_verify_penalties(batch: StepPlan, chunk: int, device: torch.device) -> dict[int, Penalties]:
    """The adjustments of a verify step's logits rows, per LM-head chunk of `chunk` rows (keyed by
    the chunk's first row; rows relative to it). Row j of an asking sample's segment decides output
    token len(tokens) + j, so it counts the accepted tokens plus the segment's first j drafts: what
    plain decoding would count at that position, had the drafts been accepted."""
    per_chunk: dict[int, list[RowHistory]] = {}
    r = 0
    for sample, span in zip(batch.samples, batch.spans, strict=True):
        params = sample.owner.request.params
        if params.adjusts_logits:
            drafts = [batch.input_ids[batch.rows[r + j]] for j in range(1, span)]
            for j in range(span):
                start = (r + j) // chunk * chunk
                history = RowHistory(r + j - start, params, [*sample.tokens, *drafts[:j]], sample.owner.prompt)
                per_chunk.setdefault(start, []).append(history)
        r += span
    return {start: stage_rows(rows, device) for start, rows in per_chunk.items()}


def stage_rows(histories: Sequence[RowHistory], device: torch.device) -> Penalties:
    """`Penalties` of the given logits rows (each asking), staged to `device` (pinned on CUDA,
    copied without waiting)."""
    rows, rep, freq, pres = [], [], [], []
    output: tuple[list[int], list[int]] = ([], [])
    prompt: tuple[list[int], list[int]] = ([], [])
    pending: tuple[list[int], list[int]] = ([], [])
    banned: tuple[list[int], list[int]] = ([], [])
    bias_at: tuple[list[int], list[int]] = ([], [])
    bias: list[float] = []
    for j, h in enumerate(histories):
        p = h.params
        rows.append(h.row)
        rep.append(p.repetition_penalty)
        freq.append(p.frequency_penalty)
        pres.append(p.presence_penalty)
        if p.frequency_penalty or p.presence_penalty or p.repetition_penalty != 1.0:
            output[0].extend([j] * len(h.output))
            output[1].extend(h.output)
            if h.pending is not None:  # its newest token is still on the device: gathered there
                pending[0].append(j)
                pending[1].append(h.pending)
        if p.repetition_penalty != 1.0:
            unique = set(h.prompt)
            prompt[0].extend([j] * len(unique))
            prompt[1].extend(unique)
        if len(h.output) + (h.pending is not None) < p.min_tokens:
            banned[0].extend([j] * len(p.stop_token_ids))
            banned[1].extend(p.stop_token_ids)
        for token, value in p.logit_bias:
            bias_at[0].append(j)
            bias_at[1].append(token)
            bias.append(value)
    pin = device.type == "cuda"

    def up(data: object, dtype: torch.dtype) -> torch.Tensor:
        host = torch.tensor(data, dtype=dtype)
        if pin:
            host = host.reshape(host.shape).pin_memory()
        return host.to(device, non_blocking=pin)

    def pairs(lists: tuple[list[int], list[int]]) -> torch.Tensor:
        return up(lists, torch.int64).reshape(2, -1)

    return Penalties(
        rows=up(rows, torch.int64),
        repetition=up(rep, torch.float32),
        frequency=up(freq, torch.float32),
        presence=up(pres, torch.float32),
        output=pairs(output),
        prompt=pairs(prompt),
        pending=pairs(pending),
        banned=pairs(banned),
        bias_at=pairs(bias_at),
        bias=up(bias, torch.float32),
    )
