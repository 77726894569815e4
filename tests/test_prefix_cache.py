"""The prefix cache: a prompt that repeats a prefix the store holds reuses its K/V, and the tokens
are exactly those of an engine that recomputes everything (fp32, the torch reference on CPU), with
the reuse counted so that a recomputed prefix fails the tests."""

from __future__ import annotations

import random

import pytest
import torch

from batchkv.executor import Engine, Request, SamplingParams, SpeculativeConfig, gather
from batchkv.executor.prefix import NoPrefixCache
from tests.executor_helpers import drive, greedy, oracle, random_prompt, working
from tests.toy_model import ToyModel

CAPACITY = 160


@pytest.fixture(scope="module")
def model():
    return ToyModel(seed=0)


def engine(model, prefix_cache=True, **kw) -> Engine:
    opts = dict(max_seqs=8, capacity=CAPACITY, max_step_tokens=32, prefill_chunk=8, prefix_cache=prefix_cache)
    return Engine(model, **(opts | kw))


def both(model, schedule, cancels=None, **kw):
    """The schedule on an engine with the prefix cache and on one without: outputs by schedule index."""
    runs = []
    for reuse in (True, False):
        e = engine(model, reuse, **kw)
        got, ids = drive(e, schedule, cancels)
        runs.append((e, [got.get(i) for i in ids]))
    return runs


def shared_prefix_schedule(rng, system, n, arrive=lambda i: 0, max_new=(3, 8)) -> list[tuple[int, Request]]:
    return [(arrive(i), Request(system + random_prompt(rng, 1, 6), greedy(rng.randint(*max_new)))) for i in range(n)]


def test_requests_sharing_a_system_prompt_reuse_it_and_decode_exactly_what_recomputing_decodes(model):
    rng = random.Random(0)
    system = random_prompt(rng, 40, 40)
    schedule = shared_prefix_schedule(rng, system, 12, arrive=lambda i: i // 3)
    (cached, with_cache), (plain, without) = both(model, schedule)
    assert with_cache == without
    for (_, request), out in zip(schedule, with_cache, strict=True):
        assert (out.tokens[0], out.finish_reasons[0]) == oracle(model, request, CAPACITY)
    m, p = cached.metrics.summary(), plain.metrics.summary()
    assert m["prefix_reused_tokens"] >= 11 * 40 and m["prefix_hit_rate"] > 0.9
    # every prompt position is either reused or computed, never both
    assert m["prefill_tokens"] + m["prefix_reused_tokens"] == p["prefill_tokens"]
    cached.assert_idle()


def test_a_prefix_shared_by_requests_arriving_in_one_step_is_prefilled_once(model):
    rng = random.Random(1)
    system = random_prompt(rng, 48, 48)
    schedule = shared_prefix_schedule(rng, system, 6)
    (cached, with_cache), (_, without) = both(model, schedule)
    assert with_cache == without
    suffixes = sum(len(r.prompt_ids) - len(system) for _, r in schedule)
    # the first computes the prefix; the others wait for it and clone it (none computes it again)
    assert cached.metrics.prefill_tokens == len(system) + suffixes
    assert cached.metrics.prefix_reused == 5 * len(system)


def test_a_conversation_adopts_its_own_history_without_a_copy_turn_after_turn(model):
    e = engine(model)
    rng = random.Random(2)
    history = random_prompt(rng, 20, 20)
    clones = []
    clone = e.cache.seq_clone
    e.cache.seq_clone = lambda *a, **k: clones.append(a) or clone(*a, **k)
    columns = []
    for _ in range(4):
        rid = e.submit(Request(history, greedy(6)))
        out = gather(e.run_until_done())[rid]
        columns.append(sorted(h.seq for h in e.scheduler.prefix.cached))
        want = oracle(model, Request(history, greedy(6)), CAPACITY)
        assert (out.tokens[0], out.finish_reasons[0]) == want
        history = history + out.tokens[0] + random_prompt(rng, 3, 5)  # the answer, then the next user turn
    assert clones == []  # every turn took its own history's column over
    assert len(set(map(tuple, columns))) == 1  # one column all along
    turns = e.metrics.summary()
    assert turns["prefix_hit_rate"] == 0.75  # turns 2-4
    e.assert_idle()


@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e4m3fn])
def test_multi_turn_chats_interleaved_with_n_samples_stops_and_cancellation_match_recomputing(model, kv_dtype):
    rng = random.Random(3)
    system = random_prompt(rng, 24, 24)
    schedule = []
    for i in range(10):
        params = SamplingParams(max_new_tokens=rng.randint(3, 9), n=1 + i % 3, temperature=0.9, seed=i,
                                stop_token_ids=(5, 11) if i % 4 == 0 else ())  # fmt: skip
        schedule.append((i, Request(system + random_prompt(rng, 2, 12), params)))
    cancels = {4: [3], 8: [7]}
    (cached, with_cache), (_, without) = both(model, schedule, cancels, kv_dtype=kv_dtype)
    assert with_cache == without
    assert cached.metrics.prefix_reused > 0
    cached.assert_idle()


def test_ngram_speculation_with_the_prefix_cache_is_still_lossless(model):
    rng = random.Random(4)
    base = random_prompt(rng, 8, 8)
    system = base * 4  # repeats itself: n-gram drafts find matches
    schedule = shared_prefix_schedule(rng, system, 6, arrive=lambda i: 2 * i)
    (cached, with_cache), (_, without) = both(model, schedule, speculative=SpeculativeConfig("ngram", block_size=4))
    assert with_cache == without and cached.metrics.prefix_reused > 0


def test_eviction_under_memory_pressure_loses_no_token_and_reads_no_stale_kv(model):
    # A store of 128 positions holds a few histories of ~30: cached ones are evicted for new requests,
    # and every evicted column is poisoned with NaN first, so a stale read would show.
    rng = random.Random(5)
    prompts = [random_prompt(rng, 20, 30) for _ in range(3)]
    schedule = [(i, Request(prompts[i % 3] + random_prompt(rng, 1, 4), greedy(rng.randint(3, 6)))) for i in range(16)]
    e = engine(model, kv_positions=128, max_seqs=4, capacity=60)
    removed = e.cache.seq_rm

    def poison_then_rm(seq):
        for layer in range(e.cache.config.num_layers):
            for plane in e.cache.column(seq, layer).values():
                plane.fill_(float("nan"))
        removed(seq)

    e.cache.seq_rm = poison_then_rm
    got, ids = drive(e, schedule)
    for (_, request), rid in zip(schedule, ids, strict=True):
        assert (got[rid].tokens[0], got[rid].finish_reasons[0]) == oracle(model, request, 60)
    assert e.metrics.prefix_evictions > 0 and e.metrics.prefix_reused > 0
    e.assert_idle()


def test_a_donor_cancelled_mid_prefill_leaves_its_waiters_to_compute_the_prefix(model):
    rng = random.Random(6)
    system = random_prompt(rng, 64, 64)
    schedule = shared_prefix_schedule(rng, system, 4, max_new=(4, 4))
    e = engine(model)
    ids = [e.submit(request) for _, request in schedule]
    events = e.step()  # the first request prefills a chunk; the others wait for it
    assert e.num_waiting == 3 and e.scheduler.prefilling[0].id == ids[0]
    e.cancel(ids[0])
    for _ in working(e):
        events += e.step()
    outputs = gather(events)
    assert outputs[ids[0]].finish_reasons == ["cancelled"]
    for rid, (_, request) in zip(ids[1:], schedule[1:], strict=True):
        assert (outputs[rid].tokens[0], outputs[rid].finish_reasons[0]) == oracle(model, request, CAPACITY)
    e.assert_idle()


def test_a_ring_layer_is_reused_only_where_it_still_holds_the_window(model):
    # The toy model's second layer is a ring of window 8 (15 rows with 8-token chunks): a finished
    # 40-token history keeps only its last rows there, so a prompt sharing its first 30 tokens
    # cannot reuse it (below the ring floor), while one continuing the whole history can.
    rng = random.Random(7)
    first = random_prompt(rng, 40, 40)
    e = engine(model)
    e.submit(Request(first, greedy(2)))
    e.run_until_done()
    partial = Request(first[:30] + random_prompt(rng, 5, 5), greedy(3))
    whole = Request(first + random_prompt(rng, 5, 5), greedy(3))
    for request, reused in ((partial, 0), (whole, True)):
        before = e.metrics.prefix_reused
        rid = e.submit(request)
        out = gather(e.run_until_done())[rid]
        assert (out.tokens[0], out.finish_reasons[0]) == oracle(model, request, CAPACITY)
        assert (e.metrics.prefix_reused - before > 0) == bool(reused)


def test_the_prefix_cache_is_off_when_asked_and_under_a_dflash_drafter(model):
    from batchkv.errors import ConfigError
    from batchkv.models import build_model
    from batchkv.models.dflash import build_drafter

    assert isinstance(engine(model, prefix_cache=False).scheduler.prefix, NoPrefixCache)
    with pytest.raises(ConfigError, match="prefix_cache"):
        engine(model, prefix_cache="yes")
    target = build_model("sensenova-u1-tiny", "cpu", seed=0)
    drafter = build_drafter(target, num_layers=1, target_layer_ids=(0, 3), block_size=4)
    speculating = Engine(target, max_seqs=2, capacity=64, speculative=SpeculativeConfig("dflash", drafter=drafter))
    assert isinstance(speculating.scheduler.prefix, NoPrefixCache)  # the drafter's cache would lack the reused context


def test_with_no_room_beside_a_cached_history_its_column_is_taken_over_not_recomputed(model):
    # One column: the repeated prompt's history cannot be cloned beside itself, so the request
    # takes that column over (rewound to the match) instead of evicting it and recomputing.
    e = engine(model, max_seqs=1)
    prompt = random_prompt(random.Random(8), 30, 30)
    outs = []
    for _ in range(2):
        rid = e.submit(Request(prompt, greedy(5)))
        outs.append(gather(e.run_until_done())[rid])
    want = oracle(model, Request(prompt, greedy(5)), CAPACITY)
    assert all((out.tokens[0], out.finish_reasons[0]) == want for out in outs)
    assert e.metrics.prefix_reused == len(prompt) - 1 and e.metrics.prefix_evictions == 0


@pytest.mark.parametrize("sliding", [False, True])
def test_a_transformers_qwen3_conversation_reuses_its_history_and_decodes_what_generate_decodes(sliding):
    # Sliding-window layers keep only their window: a turn reuses its own history (the whole of it is
    # above every ring floor), never a position a ring has overwritten.
    from batchkv.models.hf import HFModel
    from tests.test_executor_models import _qwen3

    hf = _qwen3(use_sliding_window=True, sliding_window=6, max_window_layers=1) if sliding else _qwen3()
    e = Engine(HFModel(hf), max_seqs=2, capacity=160, max_step_tokens=16, prefill_chunk=8)
    rng = random.Random(13)
    history: list[int] = []
    reusable = 0  # the positions each turn finds written: its history but the last token (never fed back)
    for turn in range(3):
        prompt = history + random_prompt(rng, 20, 30, vocab=256)
        rid = e.submit(Request(prompt, greedy(6)))
        out = gather(e.run_until_done())[rid]
        with torch.no_grad():
            full = hf.generate(
                torch.tensor([prompt]), max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0
            )
        assert out.tokens[0] == full[0, len(prompt) :].tolist(), f"turn {turn}"
        reusable += max(len(history) - 1, 0)
        history = prompt + out.tokens[0]
    m = e.metrics.summary()
    assert m["prefix_reused_tokens"] >= reusable > 0 and m["prefix_hit_rate"] >= 2 / 3, m
    e.assert_idle()


def test_the_sensenova_tiny_model_decodes_with_the_prefix_cache_what_its_reference_decodes():
    from batchkv.models import build_model
    from batchkv.models.reference import reference_generate

    sense = build_model("sensenova-u1-tiny", "cpu", seed=0)
    rng = random.Random(17)
    system = random_prompt(rng, 40, 40, vocab=sense.vocab_size)
    schedule = [
        (i // 2, Request(system + random_prompt(rng, 2, 8, vocab=sense.vocab_size), greedy(6))) for i in range(6)
    ]
    e = Engine(sense, max_seqs=4, capacity=96, max_step_tokens=32, prefill_chunk=16)
    got, ids = drive(e, schedule)
    for index, (_, request) in enumerate(schedule):
        expected = reference_generate(sense, request.prompt_ids, request.params.max_new_tokens)
        assert got[ids[index]].tokens == [expected], f"request {index}"
    m = e.metrics.summary()
    assert m["prefix_hit_rate"] >= 5 / 6 and m["prefix_reused_tokens"] >= 5 * 16, m  # each later request reuses
    e.assert_idle()
