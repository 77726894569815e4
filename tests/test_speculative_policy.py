"""Draft lengths that follow acceptance (`batchkv.executor.speculative.policy`): a steady acceptance
length is tracked and never cut below, drafting stops when nothing is accepted and probes at
doubling intervals, and in the engine the output stays exactly that of decoding without drafts."""

from __future__ import annotations

from functools import partial

import pytest

from batchkv.executor import SpeculativeConfig
from batchkv.executor.speculative.policy import MAX_WAIT, DraftLengths
from batchkv.executor.state import RequestState, SampleState
from tests.executor_helpers import working
from tests.spec_helpers import ForcedProposer, plain_and_speculative
from tests.test_speculative import OPTS, repetitive_schedule
from tests.toy_model import ToyModel


def _sample() -> SampleState:
    return SampleState(RequestState(0, None, 0, 0.0), 0)  # type: ignore[arg-type]


def _run(lengths: DraftLengths, sample: SampleState, steps: int, accepts) -> list[tuple[int, int]]:
    """(drafts proposed, accepted) per step; accepts(k) says how many of k drafts pass. Each step
    emits the accepted drafts and one more token, as a verify step does."""
    out = []
    for _ in range(steps):
        k = lengths.next(sample)
        a = accepts(k)
        if k:
            lengths.update(sample, k, a)
        sample.tokens += [0] * (a + 1)
        out.append((k, a))
    return out


@pytest.mark.parametrize("tau", [2, 3, 4, 7, 11, 16])
def test_a_steady_acceptance_length_is_tracked_and_never_cut_below(tau):
    lengths, sample = DraftLengths(15), _sample()
    steps = _run(lengths, sample, 30, lambda k: min(k, tau - 1))  # draft tau is always wrong
    assert all(a == tau - 1 for _, a in steps)  # every step emits tau tokens
    assert all(k <= max(tau, 2 * (tau - 1), 1) for k, _ in steps[5:])  # and verifies few more rows


def test_drafting_stops_when_nothing_is_accepted_and_probes_with_one_draft_at_doubling_intervals():
    lengths, sample = DraftLengths(15), _sample()
    drafts = [k for k, _ in _run(lengths, sample, 80, lambda k: 0)]
    assert drafts[:4] == [15, 7, 3, 1]
    probes = [i for i, k in enumerate(drafts) if i >= 4 and k]
    assert all(drafts[i] == 1 for i in probes)
    gaps = [b - a for a, b in zip([3, *probes], probes, strict=False)]
    assert gaps[:4] == [2, 4, 8, 16] and set(gaps[4:]) == {MAX_WAIT}


def test_a_passing_probe_resumes_drafting_and_full_acceptance_doubles_to_the_block():
    lengths, sample = DraftLengths(15), _sample()
    _run(lengths, sample, 6, lambda k: 0)  # down to 0, then one failed probe
    steps = _run(lengths, sample, 10, lambda k: k)  # everything passes from now on
    assert [k for k, _ in steps if k][:5] == [1, 2, 4, 8, 15]
    assert [k for k, _ in steps][-3:] == [15, 15, 15]


def test_a_block_cut_short_by_the_request_does_not_shrink_the_length():
    lengths, sample = DraftLengths(15), _sample()
    assert lengths.next(sample) == 15
    lengths.update(sample, 3, 3)  # only 3 drafts fit before max_new_tokens; all passed
    assert lengths.next(sample) == 15


def test_fixed_lengths_always_take_the_whole_block_and_finished_samples_are_forgotten():
    fixed, sample = DraftLengths(15, fixed=True), _sample()
    assert [k for k, _ in _run(fixed, sample, 5, lambda k: 0)] == [15] * 5
    adaptive = DraftLengths(15)
    adaptive.next(sample)
    sample.finish = "length"
    adaptive.release()
    assert adaptive._states == {}


def test_rejected_drafts_stop_being_proposed_and_the_tokens_stay_those_of_plain_decoding():
    model = ToyModel(seed=0)
    schedule = repetitive_schedule(5)
    wrong = partial(ForcedProposer, vocab=97, corrupt=lambda emitted, j: j == 0)  # the first draft always fails
    proposed = {}
    for adaptive in (True, False):
        spec = SpeculativeConfig("ngram", block_size=8, adaptive=adaptive)
        plain, fast, engine = plain_and_speculative(model, schedule, spec, proposer=wrong, **OPTS)
        assert fast == plain
        m = engine.metrics
        assert m.spec_accepted == 0 and m.spec_segments > 0
        proposed[adaptive] = m.spec_proposed
        if adaptive:
            assert m.spec_segments < 0.5 * m.generated_tokens  # most steps carried no drafts
    assert proposed[True] < 0.25 * proposed[False]


def test_adaptive_must_be_a_bool():
    from batchkv.errors import ConfigError

    with pytest.raises(ConfigError, match="adaptive"):
        SpeculativeConfig("ngram", adaptive="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("fail_at", [4, 6, 8, 10])
def test_a_step_that_raises_leaves_every_draft_length_as_it_was(fail_at):
    """Drafts that always fail send the draft length to 0 and into probes; a launch that raises and
    is planned again must not count as a step: the same drafts, then the same sampled tokens."""
    from batchkv.executor import Engine, Request, SamplingParams, gather

    model = ToyModel(seed=0)
    request = Request([3, 4, 5, 3, 4, 5, 3, 4], SamplingParams(max_new_tokens=30, temperature=0.8, seed=7))

    def serve(fail: int | None) -> tuple[list[int], list[list[int]]]:
        engine = Engine(model, speculative=SpeculativeConfig("ngram", block_size=4), **OPTS)
        engine.speculator.proposer = ForcedProposer({(request.prompt_ids, 0): [96] * 40}, vocab=97)
        spans, calls, launch = [], [0], engine.runner.launch

        def failing(batch, width, previous=None):
            calls[0] += 1
            if calls[0] == fail:
                raise RuntimeError("injected forward failure")
            tokens = launch(batch, width, previous)
            spans.append(list(batch.spans))
            return tokens

        engine.runner.launch = failing
        rid = engine.submit(request)
        events = []
        for _ in working(engine):
            try:
                events += engine.step()
            except RuntimeError:
                assert calls[0] == fail
        return gather(events)[rid].tokens[0], spans

    tokens, spans = serve(None)
    assert any(span == [1] for span in spans[3:])  # the failure lands while drafting is off or probing
    assert serve(fail_at) == (tokens, spans)


def test_a_passing_probe_never_resumes_past_the_block():
    lengths, sample = DraftLengths(1), _sample()  # block_size 2: one draft at most
    steps = _run(lengths, sample, 6, lambda k: 0) + _run(lengths, sample, 6, lambda k: k)
    assert {k for k, _ in steps} == {0, 1}


def test_a_block_of_two_recovers_from_rejected_drafts_and_decodes_as_without_them():
    model = ToyModel(seed=0)
    schedule = repetitive_schedule(6)
    late = partial(ForcedProposer, vocab=97, corrupt=lambda emitted, j: emitted < 4)  # wrong, then right
    spec = SpeculativeConfig("ngram", block_size=2)  # with prefill_chunk 2, max_write is 2: a 3-row verify is refused
    plain, fast, engine = plain_and_speculative(model, schedule, spec, proposer=late, **(OPTS | {"prefill_chunk": 2}))
    assert fast == plain
    assert 0 < engine.metrics.spec_accepted < engine.metrics.spec_proposed
