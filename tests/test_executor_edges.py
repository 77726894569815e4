"""The finish edges, each served plainly, with overlap and with speculation (drafts forced to the
known continuation, so accepted runs reach the edges), against the eager oracle: a stop id that is
also the last allowed token, max_new_tokens 1 with n > 1, a prompt one short of capacity, length
and capacity reached by the same token, a stop at the first token of n samples. Columns are
reused across the schedule (max_seqs 3) and every one is free at the end."""

from __future__ import annotations

import pytest

from batchkv.executor import Engine, Request, SpeculativeConfig
from tests.executor_helpers import drive, greedy, oracle
from tests.spec_helpers import ForcedProposer
from tests.toy_model import ToyModel

CAPACITY = 20


@pytest.fixture(scope="module")
def model():
    return ToyModel(seed=0)


def first_new(model, prompt: list[int], k: int) -> int:
    """The greedy oracle's k-th token (0-based) for `prompt`, checked not to occur before it."""
    free, _ = oracle(model, Request(prompt, greedy(k + 1)), CAPACITY)
    assert free[k] not in free[:k], "pick another prompt: the token repeats"
    return free[k]


def edge_schedule(model) -> list[tuple[int, Request]]:
    long = list(range(1, CAPACITY))  # capacity - 1 positions: one token is written, one more emitted
    stop_prompt = [5, 17, 33, 2]
    first_prompt = [9, 4, 60]
    return [
        (0, Request(stop_prompt, greedy(4, stop_token_ids=(first_new(model, stop_prompt, 3),)))),  # stop == last
        (0, Request([7, 8, 9], greedy(1, n=3))),  # every sample's only token comes from the prompt's row
        (1, Request(long, greedy(10))),  # capacity
        (1, Request(long, greedy(2))),  # length and capacity on the same token: length
        (2, Request(first_prompt, greedy(6, n=2, stop_token_ids=(first_new(model, first_prompt, 0),)))),
        (3, Request([3, 1, 4, 1, 5], greedy(12))),
    ]


MODES = {
    "plain": {"overlap": False},
    "overlap": {"overlap": True},
    "speculative": {"speculative": SpeculativeConfig("ngram", block_size=4)},
}


@pytest.mark.parametrize("mode", list(MODES))
def test_every_finish_edge_decodes_as_the_oracle_in_every_mode(model, mode):
    schedule = edge_schedule(model)
    engine = Engine(model, max_seqs=3, capacity=CAPACITY, max_step_tokens=16, prefill_chunk=8, **MODES[mode])
    if mode == "speculative":
        known = {(r.prompt_ids, s): oracle(model, r, CAPACITY)[0] for _, r in schedule for s in range(r.params.n)}
        engine.speculator.proposer = ForcedProposer(known, vocab=97)
    outputs, ids = drive(engine, schedule)
    for index, (_, request) in enumerate(schedule):
        tokens, reason = oracle(model, request, CAPACITY)
        out = outputs[ids[index]]
        assert out.tokens == [tokens] * request.params.n and out.finish_reasons == [reason] * request.params.n, index
    reasons = [outputs[rid].finish_reasons[0] for rid in ids]
    assert reasons == ["stop", "length", "capacity", "length", "stop", "length"]
    assert [len(outputs[rid].tokens[0]) for rid in ids[:4]] == [4, 1, 2, 2]
    if mode == "speculative":
        assert engine.metrics.spec_accepted > 0
    engine.assert_idle()
