"""Every capacity, floor, window and bucket edge, on both sides: the value at the edge is accepted
(or allocated) and the one past it refused, so a comparison that is off by one fails a test."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from batchkv import CacheConfig, LayerSpec
from batchkv.errors import CapacityError, PositionError, RequestError, RingFloorError, StepError
from batchkv.executor import MAX_SAMPLE_ROWS, Engine, Request, SamplingParams
from batchkv.executor.sampling import sample_tokens
from tests.executor_helpers import working
from tests.test_cache import make_pair
from tests.toy_model import ToyModel

RING = (LayerSpec("flat"), LayerSpec("ring", window=4))  # max_write 3: a ring of 4 + 3 - 1 = 6 rows


# ---- ring floor --------------------------------------------------------------------------------
def test_a_ring_filled_to_exactly_its_rows_has_overwritten_nothing_so_its_floor_is_zero():
    pair = make_pair(RING, max_write=3)
    assert pair.cache.config.ring_rows(1) == 6
    a = pair.new()
    pair.step([a, a, a])
    pair.step([a, a, a])  # positions 0..5 fill the 6 rows; none is overwritten
    assert pair.cache.ring_floor(a) == 0
    b = pair.clone(a, upto=0)
    pair.rewind(a, 0)
    pair.step([a, a, a, b, b, b])  # both restart from nothing and match the oracle
    pair.step([a, b])


def test_one_position_past_the_ring_rows_sets_the_floor_and_the_floor_itself_is_allowed():
    pair = make_pair(RING, max_write=3)
    a = pair.new()
    for ids in ([a, a, a], [a, a, a], [a]):
        pair.step(ids)  # 7 written: position 6 overwrote position 0
    floor = 7 - 3
    assert pair.cache.ring_floor(a) == floor
    with pytest.raises(RingFloorError):
        pair.cache.rewind(a, floor - 1)
    with pytest.raises(RingFloorError):
        pair.cache.seq_clone(a, upto=floor - 1)
    b = pair.clone(a, upto=floor)
    pair.rewind(a, floor)
    pair.step([a, a, a, b, b, b])  # a full max_write step from the floor still reads a whole window


def test_a_ring_capped_by_capacity_never_wraps_so_a_full_sequence_rewinds_to_zero():
    pair = make_pair(RING, max_write=3, capacity=5)
    assert pair.cache.config.ring_rows(1) == 5  # min(capacity, 6)
    a = pair.new()
    pair.step([a, a, a])
    pair.step([a, a])
    assert pair.cache.pos(a) == 5 and pair.cache.ring_floor(a) == 0
    pair.rewind(a, 0)
    pair.step([a, a, a])


# ---- capacity, widths, segments ----------------------------------------------------------------
def test_a_sequence_reaches_exactly_its_capacity_and_not_one_more():
    pair = make_pair(RING, max_write=3, capacity=7)
    cache = pair.cache
    a = pair.new()
    pair.step([a, a, a])
    pair.step([a, a, a])
    assert cache.can_admit(a, 1) and not cache.can_admit(a, 2)
    with pytest.raises(CapacityError, match="capacity is 7"):
        cache.declare_step([a, a])
    pair.step([a])
    assert cache.pos(a) == 7 and not cache.can_admit(a, 1) and cache.can_admit(a, 0)
    assert cache.reserve(a, 7) is False
    with pytest.raises(CapacityError):
        cache.reserve(a, 8)


def test_step_limits_accept_their_maximum_and_refuse_one_more():
    pair = make_pair(max_seqs=3, max_write=3, max_width=7, max_segments=4)
    cache = pair.cache
    a, b, c = pair.new(), pair.new(), pair.new()
    pair.step([a, a, a])  # exactly max_write
    with pytest.raises(CapacityError, match="max_write"):
        cache.declare_step([a] * 4)
    pair.step([a, b, a, b])  # exactly max_segments runs
    with pytest.raises(CapacityError, match="max_segments"):
        cache.declare_step([a, b, a, b, c])
    pair.step([a, a, a, b, b, c, c], width=7)  # exactly max_width tokens at width max_width
    with pytest.raises(CapacityError, match="max_width"):
        cache.declare_step([a, a, a, b, b, b, c, c])
    cache.declare_step([a, b, c])
    with pytest.raises(StepError):
        cache.prepare_step(2)  # narrower than the declared tokens
    with pytest.raises(StepError):
        cache.prepare_step(8)  # wider than max_width
    cache.prepare_step(3)
    cache.prepare_step(7)


def test_clone_and_rewind_take_their_whole_range_and_nothing_outside_it():
    pair = make_pair(max_write=3)
    a = pair.new()
    pair.step([a, a, a])
    whole = pair.clone(a, upto=3)
    assert pair.cache.pos(whole) == 3
    with pytest.raises(PositionError):
        pair.cache.seq_clone(a, upto=4)
    pair.rewind(a, 3)  # to its own length: allowed, a no-op
    with pytest.raises(PositionError):
        pair.cache.rewind(a, 4)
    pair.step([a, whole])


# ---- the row schedule ----------------------------------------------------------------------------
def test_a_bucket_holds_exactly_its_rows_and_one_more_position_takes_the_next():
    cfg = CacheConfig(1, 1, 8, max_seqs=1, capacity=10_000, buckets=(16, 48), tail_step=32)
    assert [cfg.rows_for(n) for n in (1, 16, 17, 48, 49, 80, 81)] == [16, 16, 48, 48, 80, 80, 112]
    doubling = CacheConfig(1, 1, 8, max_seqs=1, capacity=1000)
    assert [doubling.rows_for(n) for n in (256, 257, 512, 513, 1000)] == [256, 512, 512, 1000, 1000]
    final = CacheConfig(1, 1, 8, max_seqs=1, capacity=100, buckets=(16, 48))
    assert [final.rows_for(n) for n in (48, 49, 100)] == [48, 49, 100]  # no tail: exactly what is needed


# ---- sampling ------------------------------------------------------------------------------------
def reachable(vocab: int, *, top_p: float = 1.0, top_k: int = 0) -> set[int]:
    """Tokens inverse-CDF sampling can return over a fine grid of draws, for uniform logits."""
    draws = torch.arange(0, 1 << 24, 1 << 12, dtype=torch.float32) / (1 << 24)  # 4096 draws in [0, 1)
    draws = torch.cat([draws, torch.tensor([1 - 2**-24])])
    rows = draws.numel()
    logits = torch.zeros(rows, vocab)
    temperature, k, p = torch.ones(rows), torch.full((rows,), top_k), torch.full((rows,), top_p)
    return set(sample_tokens(logits, temperature, k, p, draws).tolist())


def transformers_keeps(vocab: int, *, top_p: float = 1.0, top_k: int = 0) -> int:
    scores = torch.zeros(1, vocab)
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return int(torch.isfinite(scores).sum())


@pytest.mark.parametrize(("top_p", "top_k"), [(0.25, 0), (0.5, 0), (0.75, 0), (1.0, 0), (1.0, 2), (0.75, 2), (0.5, 3)])
def test_top_p_and_top_k_at_an_exact_tie_keep_the_lowest_ids_as_many_as_transformers(top_p, top_k):
    # Uniform logits over 4 tokens: each holds 1/4, so top_p 0.5 lands exactly on a rank boundary.
    kept = transformers_keeps(4, top_p=top_p, top_k=top_k)
    assert reachable(4, top_p=top_p, top_k=top_k) == set(range(kept))  # ties break by token id


def test_n_parallel_samples_take_up_to_the_logits_rows_and_not_one_more():
    assert SamplingParams(n=MAX_SAMPLE_ROWS).n == MAX_SAMPLE_ROWS
    with pytest.raises(RequestError):
        SamplingParams(n=MAX_SAMPLE_ROWS + 1)


# ---- admission and storage -----------------------------------------------------------------------
def run_recording_generations(engine: Engine, request: Request) -> tuple[list[int], list[int], set[int]]:
    """Run one request; the store's generation after each step, its tokens, and its column's reaches."""
    engine.submit(request)
    generations, tokens, reaches = [], [], set()
    for _ in working(engine):
        reaches |= {engine.cache.reach(seq) for seq in engine.cache.sequences}
        tokens += [e.token for e in engine.step() if e.token is not None]
        generations.append(engine.cache.generation)
    return generations, tokens, reaches


@pytest.mark.parametrize("longest", [16, 17])
def test_admission_reserves_every_position_a_request_can_reach_so_decode_never_grows(longest):
    # The last generated token is never written: a request holds at most prompt + max_new - 1.
    prompt = list(range(1, 9))
    engine = Engine(ToyModel(seed=1), max_seqs=2, capacity=64, max_step_tokens=8, prefill_chunk=8, row_buckets=(16, 32))
    params = SamplingParams(max_new_tokens=longest - len(prompt) + 1)
    generations, tokens, reaches = run_recording_generations(engine, Request(prompt, params))
    assert len(tokens) == params.max_new_tokens
    assert len(set(generations)) == 1, generations  # no growth from the first step to the last
    assert reaches == {longest}  # its column holds what the request can reach, no more


def test_a_prompt_one_short_of_capacity_is_admitted_and_one_at_capacity_refused():
    engine = Engine(ToyModel(seed=1), max_seqs=2, capacity=12, max_step_tokens=8, prefill_chunk=8)
    with pytest.raises(RequestError, match="capacity is 12"):
        engine.submit(Request(list(range(12)), SamplingParams(max_new_tokens=4)))
    _, tokens, _ = run_recording_generations(engine, Request(list(range(11)), SamplingParams(max_new_tokens=4)))
    assert len(tokens) == 2  # the first is written at position 11, the second can never be


def test_a_prompt_of_exactly_one_chunk_samples_in_its_first_step_and_one_more_token_takes_two():
    for prompt_len, steps_to_first_token in ((8, 1), (9, 2)):
        engine = Engine(ToyModel(seed=1), max_seqs=2, capacity=64, max_step_tokens=8, prefill_chunk=8)
        engine.submit(Request(list(range(1, prompt_len + 1)), SamplingParams(max_new_tokens=2)))
        steps = 1
        while not [e for e in engine.step() if e.token is not None]:
            steps += 1
            assert steps <= 4, f"a {prompt_len}-token prompt gave no token in {steps - 1} steps"
        assert steps == steps_to_first_token, prompt_len


def test_a_step_of_exactly_a_bucket_width_is_not_padded():
    engine = Engine(ToyModel(seed=1), max_seqs=4, capacity=64, max_step_tokens=8, prefill_chunk=4, width_buckets=(4, 8))
    engine.submit(Request([1, 2, 3, 4], SamplingParams(max_new_tokens=1)))
    engine.step()
    assert engine.metrics.padded_tokens == 0 and dict(engine.metrics.widths) == {4: 1}
