"""Shared pieces of the speculative-decoding tests: proposers that know the answer, and drivers
that compare an engine with speculation against the same schedule decoded without it."""

from __future__ import annotations

from batchkv.executor import Engine, Request
from batchkv.executor.speculative.speculator import Drafts, NgramProposer
from tests.executor_helpers import drive


class ForcedProposer(NgramProposer):
    """Proposes each sample's known continuation (from a run without speculation), so long
    accepted runs and full blocks happen; `corrupt(emitted, j)` may replace draft j with a wrong
    token (then it must be rejected there). Samples it does not know get no drafts."""

    def __init__(self, known: dict[tuple[tuple[int, ...], int], list[int]], vocab: int, corrupt=None) -> None:
        super().__init__(ngram_max=1)
        self.known, self.vocab, self.corrupt = known, vocab, corrupt
        self.proposed: list[list[int]] = []

    def propose(self, batch, samples, counts) -> Drafts:
        out = []
        for sample, count in zip(samples, counts, strict=True):
            future = self.known.get((sample.owner.prompt, sample.index), [])
            emitted = len(sample.tokens)
            drafts = list(future[emitted : emitted + count])
            for j in range(len(drafts)):
                if self.corrupt is not None and self.corrupt(emitted, j):
                    drafts[j] = (drafts[j] + 1) % self.vocab
            out.append(drafts)
        self.proposed.append([len(d) for d in out])
        return Drafts(out)


def plain_and_speculative(model, schedule, spec, *, cancels=None, proposer=None, **engine_kwargs):
    """Run `schedule` on an engine without and with `spec`; returns (plain outputs by schedule
    index, speculative outputs by schedule index, the speculative engine). Both end idle."""
    plain = Engine(model, **engine_kwargs)
    outputs, ids = drive(plain, schedule, cancels)
    plain.assert_idle()
    fast = Engine(model, speculative=spec, **engine_kwargs)
    if proposer is not None:
        fast.speculator.proposer = proposer(known_continuations(schedule, outputs, ids))
    got, got_ids = drive(fast, schedule, cancels)
    fast.assert_idle()
    return [outputs[i] for i in ids], [got[i] for i in got_ids], fast


def known_continuations(schedule: list[tuple[int, Request]], outputs, ids) -> dict:
    known = {}
    for index, (_, request) in enumerate(schedule):
        for sample, tokens in enumerate(outputs[ids[index]].tokens):
            known[(request.prompt_ids, sample)] = tokens
    return known


def forced_dflash(proposer, known: dict, corrupt=None):
    """Make a DFlash proposer's drafts the known continuation after its drafter ran (so the drafter
    step, its context flushes and rewinds all happen, with long accepted runs)."""
    plain_propose = proposer.propose

    def propose(batch, samples, counts):
        drafts = plain_propose(batch, samples, counts)
        for sample, src in zip(samples, drafts.src, strict=True):
            future = known.get((sample.owner.prompt, sample.index), [])
            emitted = len(sample.tokens)
            for j, index in enumerate(src):
                if emitted + j < len(future):
                    token = future[emitted + j]
                    if corrupt is not None and corrupt(emitted, j):
                        token = (token + 1) % proposer.drafter.config.vocab
                    proposer.drafts[index] = token
        return drafts

    proposer.propose = propose
