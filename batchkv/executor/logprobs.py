"""Log-probabilities of a step's tokens, from the logits the step already makes.

Two kinds of logits rows ask for them (`StepPlan.logprob_k`, planned by the scheduler): sampling rows
of requests with `SamplingParams.logprobs` (the token is the one this step samples, still on the
device) and prompt scoring rows of requests with `prompt_logprobs` (the token is the next prompt
token, known on the host). For the m rows that ask, k the most alternatives any of them wants:

    lse = logsumexp(logits[rows])                      # float32 [m, 1]
    chosen = logits[rows].gather(token) - lse          # [m, 1]: log_softmax at the token
    top = logits[rows].topk(k) - lse                   # [m, k]: the k most likely, best first

that is log_softmax of the raw float32 logits (vLLM's default, "raw_logprobs"): temperature, top-k
and top-p change what is sampled, not what is reported.

Cost of a step that asks, on top of the step: one upload of the asking rows and their tokens (int64
[2, m], pinned, before the forward), then after sampling an index_select, logsumexp, gather and
topk over float32 [m, vocab] and two copies, float32 and int64 [m, 1 + k], into pinned host slots
beside the tokens' (two slots, alternating as the tokens' do, so with overlap they are read one
step behind with the tokens, after the same event). A step where no row asks runs none of it.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

import torch

from batchkv.cache.staging import Staging
from batchkv.executor.request import MAX_LOGPROBS, Logprobs
from batchkv.executor.state import StepPlan


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's log-probability of its token and its k most likely tokens.

    logits: float32 [m, V]; tokens: int64 [m]. Returns values float32 [m, 1 + k] (the token's
    logprob, then the top k's, most likely first) and ids int64 [m, 1 + k] (the token, then the top
    k's). Static shapes, no host reads.
    """
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # [m, 1]
    chosen = logits.gather(1, tokens[:, None])
    top, ids = logits.topk(min(k, logits.shape[-1]), dim=-1)
    return torch.cat([chosen, top], dim=1) - lse, torch.cat([tokens[:, None], ids], dim=1)


@dataclass
class LogprobPlan:
    """The logits rows of one step that ask (indexes into the step's rows), the k of each, the most
    of them, and how many of the step's rows sample (the rest score prompt tokens)."""

    rows: list[int]
    ks: list[int]
    k: int
    sampling: int


class LogprobSlots:
    """A runner's logprob buffers: the staged plan (int64 [2, R]: asking rows, their tokens or -1
    for the sampled one) and two pinned host slots of [R, 1 + MAX_LOGPROBS] values and ids."""

    def __init__(self, rows: int, device: torch.device) -> None:
        self.rows = rows
        self._plan = Staging({torch.int64: 2 * rows}, device)
        self.select, self.tokens = self._plan.device_buffers[torch.int64].view(2, rows).unbind(0)
        self.pinned = device.type == "cuda"
        width = rows * (1 + MAX_LOGPROBS)
        self._values = torch.zeros(2, width, dtype=torch.float32, pin_memory=self.pinned)
        self._ids = torch.zeros(2, width, dtype=torch.int64, pin_memory=self.pinned)

    @staticmethod
    def nbytes(rows: int) -> int:
        """Bytes construction allocates (staged plan, host and device; two host slots)."""
        return Staging.nbytes({torch.int64: 2 * rows}) + 2 * rows * (1 + MAX_LOGPROBS) * (4 + 8)

    def stage(self, batch: StepPlan) -> LogprobPlan:
        """Host planning, before the forward: upload the rows of `batch` that ask and their tokens
        (a sampling row's is -1: the sampled one). `batch.logprob_k` must not be empty."""
        ks, sampling = batch.logprob_k, len(batch.rows)
        rows = [j for j, k in enumerate(ks) if k >= 0]
        host = self._plan.begin()[torch.int64].reshape(2, self.rows)
        m = len(rows)
        host[0, :m] = rows
        host[1, :m] = [-1 if j < sampling else batch.score_tokens[j - sampling] for j in rows]
        self._plan.upload()
        return LogprobPlan(rows, [ks[j] for j in rows], max(ks), sampling)

    def launch(self, plan: LogprobPlan, logits: torch.Tensor, sampled: torch.Tensor, slot: int) -> StepLogprobs:
        """Queue the logprobs of `plan`'s rows of `logits` (float32 [>= rows, V]; `sampled` int64
        [plan.sampling], this step's tokens) and their copy into host slot `slot`. No host sync."""
        m = len(plan.rows)
        select, tokens = self.select[:m], self.tokens[:m]
        if plan.sampling:  # a sampling row's token is the one just sampled, on the device
            drawn = sampled.index_select(0, select.clamp(max=plan.sampling - 1))
            tokens = torch.where(tokens >= 0, tokens, drawn)
        values, ids = token_logprobs(logits.index_select(0, select), tokens, plan.k)
        return self._copy(plan, values, ids, slot)

    def part(
        self, plan: LogprobPlan, logits: torch.Tensor, lo: int, hi: int, sampled: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`launch`'s values and ids for the plan's rows in [lo, hi) only, whose logits are
        `logits[row - lo]` (one chunk of a step whose LM head runs in chunks; `sampled` holds at
        least the tokens of the chunk's sampling rows). None when none of its rows asks."""
        first, stop = bisect_left(plan.rows, lo), bisect_left(plan.rows, hi)
        if first == stop:
            return None
        select, tokens = self.select[first:stop], self.tokens[first:stop]
        if plan.sampling:
            drawn = sampled.index_select(0, select.clamp(max=plan.sampling - 1))
            tokens = torch.where(tokens >= 0, tokens, drawn)
        return token_logprobs(logits.index_select(0, select - lo), tokens, plan.k)

    def finish(self, plan: LogprobPlan, parts: list[tuple[torch.Tensor, torch.Tensor]], slot: int) -> StepLogprobs:
        """Queue the copy of a chunked step's `part`s (in row order) into host slot `slot`."""
        values = torch.cat([values for values, _ in parts])
        ids = torch.cat([ids for _, ids in parts])
        return self._copy(plan, values, ids, slot)

    def _copy(self, plan: LogprobPlan, values: torch.Tensor, ids: torch.Tensor, slot: int) -> StepLogprobs:
        m, width = len(plan.rows), values.shape[1]  # 1 + k (k at most the vocabulary)
        host_values = self._values[slot, : m * width].view(m, width)
        host_ids = self._ids[slot, : m * width].view(m, width)
        host_values.copy_(values, non_blocking=self.pinned)
        host_ids.copy_(ids, non_blocking=self.pinned)
        return StepLogprobs(plan, host_values, host_ids)


class StepLogprobs:
    """A launched step's logprobs in a pinned host slot; read once the step's event has passed."""

    def __init__(self, plan: LogprobPlan, values: torch.Tensor, ids: torch.Tensor) -> None:
        self.plan, self.values, self.ids = plan, values, ids

    def read(self) -> tuple[list[Logprobs | None], list[Logprobs]]:
        """(per sampling row its token's `Logprobs`, None where its request did not ask; per prompt
        scoring row, in order, the scored token's)."""
        plan = self.plan
        values, ids = self.values.tolist(), self.ids.tolist()
        sampled: list[Logprobs | None] = [None] * plan.sampling
        scored: list[Logprobs] = []
        for i, (row, k) in enumerate(zip(plan.rows, plan.ks, strict=True)):
            entry = Logprobs(ids[i][0], values[i][0], tuple(zip(ids[i][1 : 1 + k], values[i][1 : 1 + k], strict=True)))
            if row < plan.sampling:
                sampled[row] = entry
            else:
                scored.append(entry)
        return sampled, scored


def row_ks(batch: StepPlan) -> list[int]:
    """`StepPlan.logprob_k` of a planned step: per sampling row its request's `logprobs` (-1: none),
    then per scoring row its request's `prompt_logprobs`; empty when no row asks."""
    ks = [-1 if (k := s.owner.request.params.logprobs) is None else k for s in batch.samples]
    for state, count in batch.scores:
        ks += [state.request.params.prompt_logprobs] * count
    return ks if any(k >= 0 for k in ks) else []
