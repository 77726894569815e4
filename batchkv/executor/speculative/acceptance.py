"""Acceptance of draft tokens on the device: per-row decisions, then one small result per segment.

A verify segment is a sample's rows `[anchor, d1 .. dk]` of one step; row i's logits judge draft
d(i+1) ("the next draft", -1 on the segment's last row). Every sampling row of a step is a
segment: a plain decode token or a prompt's last token is a segment with k = 0.

Per row (`greedy_rows`, `sampled_rows`):
- ok: the next draft is accepted at this row;
- fix: the token emitted if the segment stops here (the first rejection, or the bonus token after
  the last row).
Greedy rows accept when the draft equals the argmax and fix is the argmax. Sampled rows run
standard speculative rejection sampling with a point-mass proposal (n-gram and DFlash drafts are
each row's argmax or lookup, so q(d) = 1): accept d with probability min(1, p(d) / q(d)) = p(d),
else draw from the normalised residual max(0, p - q), which is p with d removed. p is the row's
filtered distribution (temperature, top-k, top-p), exactly what plain sampling draws from, so the
emitted tokens have plain sampling's distribution.

`combine` turns the per-row decisions into `[S, block + 1]` int64: per segment the number of tokens
emitted (accepted drafts + 1) and the tokens, -1 past them. The host reads that tensor once a step.
Everything here is graph-safe: static shapes, no host reads.
"""

from __future__ import annotations

import torch

from batchkv.executor.sampling import filtered_probs


def greedy_rows(logits: torch.Tensor, draft_next: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [R, V] (any float dtype: argmax only), draft_next int64 [R] -> ok bool [R], fix int64 [R]."""
    target = logits.argmax(-1)
    return draft_next == target, target


def sampled_rows(
    logits: torch.Tensor,
    draft_next: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    u_accept: torch.Tensor,
    u_draw: torch.Tensor,
    min_p: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling per row (see the module docstring); temperature-0 rows decide greedily.

    logits float32 [R, V]; draft_next int64 [R] (-1: no draft); temperature, top_p, u_accept,
    u_draw float32 [R]; top_k int64 [R]; min_p float32 [R] or None (`filtered_probs`). Returns
    ok bool [R], fix int64 [R].
    """
    probs, order, keep = filtered_probs(logits, temperature, top_k, top_p, min_p)  # sorted order
    probs = probs / probs.sum(-1, keepdim=True)  # top-p leaves the kept mass below 1
    is_draft = order == draft_next[:, None]
    ok = u_accept < (probs * is_draft).sum(-1)  # p(d); 0 for a filtered draft or none
    residual = probs.masked_fill(is_draft, 0.0)
    cum = residual.cumsum(-1)
    # Inverse CDF: the first rank whose cumulative mass passes u * total has mass > 0.
    choice = (cum <= u_draw[:, None] * cum[:, -1:]).sum(-1)
    rank = torch.arange(probs.shape[-1], device=probs.device)
    last = torch.where(residual > 0, rank, 0).amax(-1)  # rounding never picks past the last mass
    choice = torch.minimum(choice, torch.minimum(last, (keep.sum(-1) - 1).clamp(min=0)))
    fix = order.gather(1, choice[:, None]).squeeze(1)
    greedy = temperature <= 0
    target = logits.argmax(-1)
    return torch.where(greedy, draft_next == target, ok), torch.where(greedy, target, fix)


def combine(
    ok: torch.Tensor,
    fix: torch.Tensor,
    draft_next: torch.Tensor,
    seg_start: torch.Tensor,
    seg_len: torch.Tensor,
    block: int,
) -> torch.Tensor:
    """Per segment: `[emitted, t0, t1, ...]`, int64 [S, block + 1].

    ok, fix, draft_next: [R] per logits row; seg_start, seg_len: int64 [S] (segment s covers rows
    [start, start + len); len 0 marks padding). emitted = a + 1 where a counts the leading
    accepted drafts; tokens are d1..da then fix at row a, -1 after.
    """
    rows = ok.shape[0]
    j = torch.arange(block, device=ok.device)[None, :]  # [1, B]
    idx = (seg_start[:, None] + j).clamp(max=rows - 1)  # [S, B]
    accepted = ok[idx] & (j < seg_len[:, None] - 1)  # the last row never accepts
    a = accepted.long().cumprod(1).sum(1)  # [S]
    bonus = fix[(seg_start + a).clamp(max=rows - 1)]
    tokens = torch.where(j < a[:, None], draft_next[idx], torch.where(j == a[:, None], bonus[:, None], -1))
    return torch.cat([(a + 1)[:, None], tokens], dim=1)
