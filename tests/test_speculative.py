"""Speculative decoding in the engine (n-gram lookup and forced proposals) against decoding without
it: greedy tokens equal token for token whatever the drafts, with staggered arrivals, n > 1, stop
ids, cancellation and capacity; sampling keeps plain sampling's distribution."""

from __future__ import annotations

import math
import random
from functools import partial

import pytest
import torch

from batchkv.errors import ConfigError
from batchkv.executor import Engine, Request, SamplingParams, SpeculativeConfig, gather
from batchkv.executor.speculative.acceptance import combine, sampled_rows
from tests.executor_helpers import greedy, oracle
from tests.spec_helpers import ForcedProposer, plain_and_speculative
from tests.toy_model import ToyModel

OPTS = {"max_seqs": 5, "capacity": 64, "max_step_tokens": 16, "prefill_chunk": 8}


@pytest.fixture(scope="module")
def model():
    return ToyModel(seed=0)


def repetitive_schedule(seed: int, count: int = 9, vocab: int = 97) -> list[tuple[int, Request]]:
    """Prompts that repeat a short motif (so lookup finds matches), staggered, one with n = 3."""
    rng = random.Random(seed)
    schedule = []
    for i in range(count):
        motif = [rng.randrange(vocab) for _ in range(rng.randint(2, 5))]
        prompt = [*(motif * 8)[: rng.randint(4, 30)], i]  # distinct prompts
        params = greedy(rng.randint(1, 24), n=3 if i == 2 else 1)
        schedule.append((rng.randint(0, 10), Request(prompt, params)))
    return schedule


def test_ngram_greedy_tokens_equal_decoding_without_speculation(model):
    schedule = repetitive_schedule(1)
    plain, fast, engine = plain_and_speculative(model, schedule, SpeculativeConfig("ngram", block_size=4), **OPTS)
    assert fast == plain
    summary = engine.metrics.summary()
    assert summary["spec_proposed"] > summary["spec_accepted"] > 0  # both outcomes were exercised


@pytest.mark.parametrize("block", [2, 5, 8])
def test_forced_acceptance_takes_whole_blocks_and_stays_lossless(model, block):
    schedule = repetitive_schedule(2)
    spec = SpeculativeConfig("ngram", block_size=block)
    forced = partial(ForcedProposer, vocab=97)
    plain, fast, engine = plain_and_speculative(model, schedule, spec, proposer=forced, **OPTS)
    assert fast == plain
    m = engine.metrics
    assert m.spec_accepted == m.spec_proposed > 0  # every known draft is accepted
    full = [k for step in engine.speculator.proposer.proposed for k in step if k == block - 1]
    assert full  # whole blocks were verified
    assert m.generated_tokens == sum(len(t) for out in plain for t in out.tokens)


def test_a_wrong_draft_is_rejected_exactly_there_and_the_target_token_replaces_it(model):
    schedule = repetitive_schedule(3)
    spec = SpeculativeConfig("ngram", block_size=6)
    forced = partial(ForcedProposer, vocab=97, corrupt=lambda emitted, j: j == 2)  # the third draft is wrong
    plain, fast, engine = plain_and_speculative(model, schedule, spec, proposer=forced, **OPTS)
    assert fast == plain
    m = engine.metrics
    proposed = [k for step in engine.speculator.proposer.proposed for k in step if k]
    assert m.spec_accepted == sum(min(k, 2) for k in proposed)  # drafts before the wrong one, never after


def test_stop_ids_truncate_an_accepted_run_after_the_stop_token(model):
    prompt = [5, 17, 33, 2, 5, 17, 33]
    free_run, _ = oracle(model, Request(prompt, greedy(20)), capacity=64)
    stop = free_run[6]
    first = free_run.index(stop)
    schedule = [(0, Request(prompt, greedy(20, stop_token_ids=(stop,)))), (0, Request([9, 9, 9, 9], greedy(12)))]
    forced = partial(ForcedProposer, vocab=97)
    spec = SpeculativeConfig("ngram", block_size=8)
    plain, fast, _ = plain_and_speculative(model, schedule, spec, proposer=forced, **OPTS)
    assert fast == plain
    assert fast[0].tokens[0] == free_run[: first + 1] and fast[0].finish_reasons == ["stop"]


def test_a_block_near_capacity_is_shortened_so_it_never_crosses_it(model):
    capacity = 24
    schedule = [(0, Request(list(range(3, 20)), greedy(40))), (1, Request([4, 4, 4, 4, 4], greedy(40)))]
    forced = partial(ForcedProposer, vocab=97)
    spec = SpeculativeConfig("ngram", block_size=8)
    plain, fast, _ = plain_and_speculative(model, schedule, spec, proposer=forced, **(OPTS | {"capacity": capacity}))
    assert fast == plain
    assert fast[0].finish_reasons == ["capacity"] and len(fast[0].tokens[0]) == capacity - 17 + 1
    for index, (_, request) in enumerate(schedule):
        assert (fast[index].tokens[0], fast[index].finish_reasons[0]) == oracle(model, request, capacity)


def test_cancelling_a_speculating_request_leaves_no_trace(model):
    schedule = repetitive_schedule(4, count=6)
    schedule[1] = (0, Request([7, 8] * 10, greedy(30)))
    spec = SpeculativeConfig("ngram", block_size=4)
    forced = partial(ForcedProposer, vocab=97)
    _plain, fast, engine = plain_and_speculative(model, schedule, spec, proposer=forced, cancels={5: [1]}, **OPTS)
    assert fast[1].finish_reasons == ["cancelled"] and 0 < len(fast[1].tokens[0]) < 30
    full = plain_and_speculative(model, schedule, spec, **OPTS)[0]  # nothing cancelled
    assert fast[1].tokens[0] == full[1].tokens[0][: len(fast[1].tokens[0])]
    for index in range(len(schedule)):
        if index != 1:
            assert fast[index] == full[index]
    engine.assert_idle()


def test_speculation_is_refused_for_a_bad_block_or_a_model_without_hidden_states(model):
    with pytest.raises(ConfigError, match="block_size"):
        SpeculativeConfig("ngram", block_size=1)
    with pytest.raises(ConfigError, match="drafter"):
        SpeculativeConfig("dflash")
    with pytest.raises(ConfigError, match="capacity"):
        Engine(model, max_seqs=2, capacity=8, max_step_tokens=8, prefill_chunk=4,
               speculative=SpeculativeConfig("ngram", block_size=16))  # fmt: skip

    class LogitsOnly:
        vocab_size, device = 97, torch.device("cpu")

        def cache_spec(self):
            return model.cache_spec()

    with pytest.raises(ConfigError, match="hidden_states"):
        Engine(LogitsOnly(), max_seqs=2, capacity=64, speculative=SpeculativeConfig("ngram"))


# ---- sampling --------------------------------------------------------------------------------
def _grid(n: int) -> torch.Tensor:
    return (torch.arange(n, dtype=torch.float32) + 0.5) / n


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.7, 3, 1.0), (1.3, 0, 0.8)])
def test_one_verify_row_emits_tokens_with_exactly_the_target_distribution(temperature, top_k, top_p):
    """Over a grid of (acceptance, draw) uniforms, the token a row emits (the draft when accepted,
    else the residual draw) has the target's filtered distribution, whatever the draft."""
    vocab, n = 7, 256
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(5)) * 1.5
    u_accept, u_draw = (g.reshape(-1) for g in torch.meshgrid(_grid(n), _grid(n), indexing="ij"))
    rows = n * n
    params = (torch.full((rows,), temperature), torch.full((rows,), top_k), torch.full((rows,), top_p))
    plain = sampled_rows(logits[None].expand(rows, -1), torch.full((rows,), -1), *params, u_accept, u_draw)[1]
    expected = torch.bincount(plain, minlength=vocab).float() / rows  # no draft: plain sampling
    assert expected.max() < 1.0
    for draft in range(vocab):
        drafts = torch.full((rows,), draft)
        ok, fix = sampled_rows(logits[None].expand(rows, -1), drafts, *params, u_accept, u_draw)
        emitted = torch.where(ok, drafts, fix)
        observed = torch.bincount(emitted, minlength=vocab).float() / rows
        assert (observed - expected).abs().max() <= 2.0 / n, f"draft {draft}"


def test_combine_reads_the_accepted_prefix_then_the_correction():
    ok = torch.tensor([True, True, False, True, False, True, True, False])
    fix = torch.arange(100, 108)
    draft_next = torch.tensor([11, 12, 13, 14, -1, 21, 22, -1])
    out = combine(ok, fix, draft_next, torch.tensor([0, 5, 8]), torch.tensor([5, 3, 0]), block=5)
    assert out[0].tolist() == [3, 11, 12, 102, -1, -1]  # d1, d2 accepted; row 2 rejects d3
    assert out[1].tolist() == [3, 21, 22, 107, -1, -1]  # all drafts accepted, then the bonus


def _chi2_bound(df: int, z: float = 3.719) -> float:
    """Wilson-Hilferty upper quantile of chi-square with `df` degrees of freedom (z 3.719: p = 1e-4)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_speculative_sampling_through_the_engine_keeps_the_joint_distribution_of_tokens():
    """800 seeded requests with point-mass drafts (the greedy continuation, so drafts are often
    accepted and often rejected): the joint distribution of the first two tokens matches the
    model's exact probabilities (chi-square, cells pooled to expected counts >= 5)."""
    model = ToyModel(seed=4, vocab=6)
    prompt, temperature, count = [1, 2, 3, 4, 5], 2.0, 800

    def probs(ids: list[int]) -> torch.Tensor:
        return torch.softmax(model.reference_logits(ids)[-1] / temperature, -1)

    first = probs(prompt)
    joint = torch.stack([first[x] * probs([*prompt, x]) for x in range(6)]).flatten()  # P(t1 = x, t2 = y)
    greedy_run, _ = oracle(model, Request(prompt, greedy(3)), capacity=64)
    engine = Engine(model, max_seqs=32, capacity=64, max_step_tokens=64, prefill_chunk=8,
                    speculative=SpeculativeConfig("ngram", block_size=3))  # fmt: skip
    known = {(tuple(prompt), 0): greedy_run}
    engine.speculator.proposer = ForcedProposer(known, vocab=6)
    for seed in range(count):
        engine.submit(Request(prompt, SamplingParams(max_new_tokens=3, temperature=temperature, seed=seed)))
    outputs = gather(engine.run_until_done())
    observed = torch.zeros(36)
    for out in outputs.values():
        t1, t2 = out.tokens[0][:2]
        observed[t1 * 6 + t2] += 1
    assert engine.metrics.spec_accepted > 0 and engine.metrics.spec_proposed > engine.metrics.spec_accepted
    expected = joint * count
    order = expected.argsort()
    cells, exp_acc, obs_acc = [], 0.0, 0.0
    for i in order.tolist():  # pool the least likely cells until each pooled cell expects >= 5
        exp_acc, obs_acc = exp_acc + float(expected[i]), obs_acc + float(observed[i])
        if exp_acc >= 5:
            cells.append((obs_acc, exp_acc))
            exp_acc = obs_acc = 0.0
    if exp_acc:
        cells[-1] = (cells[-1][0] + obs_acc, cells[-1][1] + exp_acc)
    chi2 = sum((o - e) ** 2 / e for o, e in cells)
    assert chi2 < _chi2_bound(len(cells) - 1), (chi2, len(cells))


def test_seeded_speculative_sampling_is_reproducible_whatever_the_batch(model):
    request = Request([3, 4, 5, 3, 4, 5, 3, 4], SamplingParams(max_new_tokens=12, temperature=0.8, seed=7))
    spec = SpeculativeConfig("ngram", block_size=4)
    alone = Engine(model, speculative=spec, **OPTS)
    rid = alone.submit(request)
    tokens = gather(alone.run_until_done())[rid].tokens
    crowded = Engine(model, speculative=spec, **OPTS)
    for i in range(3):
        crowded.submit(Request([i, 9, i, 9, i], SamplingParams(max_new_tokens=10, temperature=1.0, seed=i)))
    rid = crowded.submit(request)
    assert gather(crowded.run_until_done())[rid].tokens == tokens


def test_inter_token_latency_under_speculation_is_one_gap_per_verify_step_never_zero(model):
    schedule = repetitive_schedule(3)
    spec = SpeculativeConfig("ngram", block_size=5)
    _, _, engine = plain_and_speculative(model, schedule, spec, proposer=partial(ForcedProposer, vocab=97), **OPTS)
    m = engine.metrics
    summary = m.summary()
    assert summary["itl_per"] == "verify step" and summary["itl_ms_p50"] > 0
    assert min(m.inter_token) > 0  # tokens accepted together are one arrival, not gaps of 0 ms
    samples = sum(request.params.n for _, request in schedule)
    assert len(m.inter_token) < m.generated_tokens - samples  # fewer gaps than tokens after the first
