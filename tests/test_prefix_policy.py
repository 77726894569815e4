"""The prefix cache's policy, pinned: what is kept, what is matched, what is evicted and in which
order. Tokens against the recomputing oracle; eviction and reuse against a plain-Python model (an
LRU list of each history's reach). The toy model's ring window here is 64, wider than the capacity,
so no ring wraps and a ring floor never stands in the way of the reuse under test."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchkv import BatchedSequenceCache, CacheConfig
from batchkv.executor import Engine, Request, SamplingParams, gather
from batchkv.executor.prefix import BLOCK, PrefixCache
from batchkv.executor.state import RequestState, SampleState
from tests.executor_helpers import greedy, oracle, random_prompt
from tests.toy_model import ToyModel

CAPACITY = 64


@pytest.fixture(scope="module")
def model():
    return ToyModel(seed=0, window=64)


def engine(model, **kw) -> Engine:
    opts = dict(max_seqs=8, capacity=CAPACITY, max_step_tokens=32, prefill_chunk=8, prefix_cache=True)
    return Engine(model, **(opts | kw))


def run(model, e: Engine, request: Request) -> list[int]:
    """Serve `request` alone to the end; its tokens, checked against the oracle."""
    rid = e.submit(request)
    out = gather(e.run_until_done())[rid]
    assert (out.tokens[0], out.finish_reasons[0]) == oracle(model, request, CAPACITY)
    return out.tokens[0]


def cached_prompts(e: Engine) -> list[tuple[int, ...]]:
    """The cached histories' prompts, least recently used first."""
    return [h.prompt for h in e.scheduler.prefix.cached]


def distinct_prompts(count: int, length: int, seed: int) -> list[list[int]]:
    """Prompts that share no first token, so that none matches another."""
    rng = random.Random(seed)
    return [[first, *random_prompt(rng, length - 1, length - 1)] for first in rng.sample(range(97), count)]


def test_a_prompt_at_another_rope_offset_reuses_nothing_and_one_at_the_same_offset_reuses_it(model):
    e = engine(model)
    prompt = random_prompt(random.Random(0), 40, 40)
    run(model, e, Request(prompt, greedy(4)))
    shifted = Request([*prompt, 5, 6], greedy(4), rope_offset=7)  # its keys are rotated at t + 7
    run(model, e, shifted)
    assert e.metrics.prefix_reused == 0
    run(model, e, Request([*prompt, 5, 6, 8], greedy(4), rope_offset=7))
    assert e.metrics.prefix_reused == len(prompt) + 2  # the history at offset 7
    e.assert_idle()


def test_a_finished_history_of_one_block_is_kept_and_one_shorter_is_not(model):
    e = engine(model)
    short, block = distinct_prompts(2, 10, seed=1)
    run(model, e, Request(short, greedy(6)))  # 10 + 5 = 15 positions written
    assert e.scheduler.prefix.held_columns == 0
    tokens = run(model, e, Request(block, greedy(7)))  # 10 + 6 = 16: one whole block
    assert e.scheduler.prefix.held_columns == 1
    run(model, e, Request(block + tokens + [3], greedy(4)))
    assert e.metrics.prefix_reused == BLOCK
    e.assert_idle()


def test_eviction_frees_least_recently_used_histories_until_their_reach_covers_the_rows_needed(model):
    # 4 x 29 + 13 positions: three finished histories of reach 29 each leave 42 free; the fourth
    # request (reach 29) fits, and a fifth needs 16 more rows: one history's reach covers them.
    e = engine(model, kv_positions=4 * 29 + 13)
    prompts = distinct_prompts(5, 20, seed=2)
    for prompt in prompts[:4]:
        run(model, e, Request(prompt, greedy(10)))  # reach 20 + 10 - 1 = 29
    lru = [(h.prompt, e.cache.reach(h.seq)) for h in e.scheduler.prefix.cached]
    assert [p for p, _ in lru] == [tuple(p) for p in prompts[:4]] and e.cache.free_rows == 13
    short, freed, expect = 29 - e.cache.free_rows, 0, 0
    while freed < short:  # the model: least recently used first, each frees its reach
        freed, expect = freed + lru[expect][1], expect + 1
    run(model, e, Request(prompts[4], greedy(10)))
    assert e.metrics.prefix_evictions == expect == 1
    assert cached_prompts(e) == [p for p, _ in lru[expect:]] + [tuple(prompts[4])]


def test_a_reused_history_becomes_the_most_recently_used_and_is_evicted_last(model):
    e = engine(model, kv_positions=4 * 29 + 13)
    prompts = distinct_prompts(5, 20, seed=3)
    for prompt in prompts[:3]:
        run(model, e, Request(prompt, greedy(10)))
    a = prompts[0]
    partial = [*a[:18], (a[18] + 1) % 97, 4]  # shares 18 tokens with the oldest history: a clone
    run(model, e, Request(partial, greedy(10)))
    assert e.metrics.prefix_reused == 18 and e.metrics.prefix_evictions == 0
    lru = [tuple(prompts[1]), tuple(prompts[2]), tuple(a), tuple(partial)]  # the model: a was touched
    assert cached_prompts(e) == lru
    run(model, e, Request(prompts[4], greedy(10)))  # needs 16 more rows: the least recently used goes
    assert cached_prompts(e) == [*lru[1:], tuple(prompts[4])]


def test_a_tie_between_a_cached_history_and_a_live_prompt_adopts_the_cached_one(model):
    # policy (docs/design.md, prefix cache): of two histories sharing as much with a prompt, the
    # finished one is taken (adopted whole: no copy) rather than a clone of the live one
    e = engine(model)
    rng = random.Random(4)
    first = random_prompt(rng, 20, 20)
    tokens = run(model, e, Request(first, greedy(13)))  # writes 20 + 12 = 32 positions
    shared = first + tokens[:12]
    (history,) = e.scheduler.prefix.cached
    assert e.cache.pos(history.seq) == len(shared)
    # a live request that computes the same 32 tokens (prompt_logprobs: it reuses nothing)
    live = Request(shared + random_prompt(rng, 10, 10), SamplingParams(max_new_tokens=10, prompt_logprobs=1))
    live_id, events = e.submit(live), []
    for _ in range(20):
        if e.scheduler.live[live_id].prefilled >= len(shared):
            break
        events += e.step()
    assert e.scheduler.live[live_id].prefilled >= len(shared)
    clones = []
    clone = e.cache.seq_clone
    e.cache.seq_clone = lambda *a, **k: clones.append(a) or clone(*a, **k)
    asker = Request([*shared, (tokens[12] + 1) % 97], greedy(5))  # shares exactly 32 with both
    asker_id = e.submit(asker)
    events += e.step()
    assert clones == [] and e.scheduler.live[asker_id].samples[0].seq == history.seq  # adopted
    events += e.run_until_done()
    out = gather(events)[asker_id]
    assert (out.tokens[0], out.finish_reasons[0]) == oracle(model, asker, CAPACITY)
    e.assert_idle()


def test_tokens_read_after_a_history_was_retired_are_matched(model):
    # The host reads a sample's last tokens after its column is retired (the pipeline plans a step
    # before the previous one's tokens are read): the history's blocks are indexed at lookup then.
    cfg = CacheConfig(num_layers=1, kv_heads=1, head_dim=4, max_seqs=4, capacity=64, max_write=64, dtype=torch.float32)
    cache = BatchedSequenceCache(cfg, "cpu", attention="reference")
    prefix = PrefixCache(cache, prefill_chunk=8)

    def column(n: int) -> int:
        seq = cache.seq_new(reach=64)
        cache._load_prefix(seq, [torch.zeros(n, 1, 4)], [torch.zeros(n, 1, 4)])
        return seq

    def state(prompt: list[int], rid: int) -> RequestState:
        s = RequestState(rid, Request(prompt, greedy(13)), seed=0, submitted=0.0)
        s.samples = [SampleState(s, 0)]
        return s

    rng = random.Random(5)
    tokens = random_prompt(rng, 32, 32)
    done = state(tokens[:20], 0)  # a finished sample: 32 positions written, its 12th token not read yet
    done.samples[0].seq, done.samples[0].tokens = column(32), tokens[20:31]
    assert prefix.keep(done.samples[0])
    done.samples[0].tokens.append(tokens[31])  # read now
    writing = state(tokens + [1] * 8, 1)  # a live prompt sharing all 32, 16 of them written
    writing.samples[0].seq, writing.prefilled = column(16), 16
    prefix.add_live(writing)
    asker = state([*tokens, 2], 2)
    match = prefix.lookup(asker)
    # the model: the longest run each history holds of the asker's first 32 tokens
    assert (match.history.seq, match.length, match.wait) == (done.samples[0].seq, 32, False)
    assert match.adopts


def test_admitting_many_prompts_visits_only_histories_that_share_a_first_token(model, monkeypatch):
    # A prompt that matches no indexed block can share only a prefix shorter than a block, which starts
    # with its first token: a lookup compares it with the histories starting alike, not with every live
    # and cached one (that made admitting N requests at once O(N^2): 256 long prompts took 70-130 ms
    # of one step on the H200's host)
    from batchkv.executor import prefix as prefix_module

    visits = []  # (the history's first token, the prompt's) per comparison
    extend = prefix_module._extend
    monkeypatch.setattr(
        prefix_module, "_extend", lambda h, p, *a: (visits.append((h.prompt[0], p[0])), extend(h, p, *a))[1]
    )
    rng = random.Random(5)
    prompts = [[i % 97, *random_prompt(rng, 20, 30)] for i in range(194)]  # each first token twice
    e = Engine(model, max_seqs=256, capacity=CAPACITY, max_step_tokens=4096, prefill_chunk=8, prefix_cache=True)
    for p in prompts:
        e.submit(Request(p, greedy(2)))
    e.step()  # admits them all
    assert e.num_running == len(prompts)
    assert len(visits) == 97 and all(a == b for a, b in visits)  # the second of each pair meets the first alone
    gather(e.run_until_done())
    for p in prompts[:3]:  # a sub-block prefix still reuses the cached history that starts alike
        before = e.metrics.prefix_reused
        run(model, e, Request([*p[:5], 7], greedy(3)))
        assert e.metrics.prefix_reused - before == 5


def test_a_lookup_does_not_walk_every_cached_history(model, monkeypatch):
    # Only a history whose tokens are still being read (overlap reads a step behind) can grow after it
    # is cached; a lookup re-indexes those, not every cached history (a server holding a thousand
    # finished columns paid for each of them at every admission)
    from batchkv.executor.prefix import History

    rng = random.Random(6)
    prompts = [[i % 97, *random_prompt(rng, 20, 30)] for i in range(150)]
    e = Engine(model, max_seqs=256, capacity=CAPACITY, max_step_tokens=4096, prefill_chunk=8, prefix_cache=True)
    for p in prompts:
        e.submit(Request(p, greedy(2)))
    gather(e.run_until_done())
    assert len(e.scheduler.prefix.cached) == len(prompts)
    run(model, e, Request([*prompts[0][:20], 3, 4], greedy(2)))  # reuses 20 positions of the first
    calls = []
    matchable = History.matchable
    monkeypatch.setattr(History, "matchable", lambda h: (calls.append(h), matchable(h))[1])
    before = e.metrics.prefix_reused
    run(model, e, Request([*prompts[1][:18], 5], greedy(2)))
    assert e.metrics.prefix_reused - before == 18
    assert 0 < len(set(calls)) <= 4  # the prompt's own candidates, not the 150 cached histories


def test_with_overlap_a_history_cached_before_its_last_tokens_are_read_is_matched_through_them(model):
    # A length finish frees (keeps) the column at launch, before the step's tokens are read: the cached
    # history grows afterwards, and a later prompt reuses the generated tokens read since
    e = engine(model, overlap=True, max_seqs=4)
    prompt = random_prompt(random.Random(7), 20, 20)
    first = run(model, e, Request(prompt, greedy(20)))
    (history,) = e.scheduler.prefix.cached
    assert history in e.scheduler.prefix._growing  # kept before its last token was read
    before = e.metrics.prefix_reused
    run(model, e, Request([*prompt, *first[:15], 1], greedy(4)))
    assert e.metrics.prefix_reused - before == 35
    assert history in e.scheduler.prefix.cached and history not in e.scheduler.prefix._growing  # all read now


class _EveryHistory(dict):
    """In place of `PrefixCache._heads`: every live and cached history for any first token (the candidates
    a lookup compared a prompt with before the first-token index)."""

    def __init__(self, prefix: PrefixCache) -> None:
        super().__init__()
        self.prefix = prefix

    def get(self, key, default=None):
        return {h: None for h in [*self.prefix._live.values(), *self.prefix.cached]}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**16), overlap=st.booleans())
def test_lookups_find_what_comparing_every_history_finds(model, seed, overlap):
    # Prompts over 3 token ids share prefixes of every length, across blocks and within the first; each
    # lookup is repeated with every history a candidate and every cached one re-indexed first (as before
    # the first-token index and the growing set), and must find the same reuse and wait
    rng = random.Random(seed)
    e = engine(model, max_seqs=6, max_step_tokens=48, overlap=overlap)
    prefix = e.scheduler.prefix
    lookup, heads = prefix.lookup, prefix._heads
    checked = []

    def checking(state):
        match = lookup(state)
        for history in prefix.cached:
            if history.matchable() // BLOCK > len(history.blocks):
                prefix._refresh(history)
        prefix._heads = _EveryHistory(prefix)
        try:
            before = lookup(state)
        finally:
            prefix._heads = heads
        checked.append(((match.length, match.wait), (before.length, before.wait)))
        return match

    prefix.lookup = checking
    base = [rng.randrange(3) for _ in range(30)]

    def wave(requests: list[Request]) -> None:  # submitted together, run to the end, checked by the oracle
        ids = [e.submit(r) for r in requests]
        out = gather(e.run_until_done())
        for rid, request in zip(ids, requests, strict=True):
            assert (out[rid].tokens[0], out[rid].finish_reasons[0]) == oracle(model, request, CAPACITY)

    def mixed(count: int) -> list[Request]:
        return [Request([rng.randrange(3) for _ in range(rng.randint(1, 40))], greedy(rng.randint(1, 12)),
                        rope_offset=rng.choice((0, 0, 0, 5))) for _ in range(count)]  # fmt: skip

    wave([Request(base, greedy(3)), *mixed(rng.randint(0, 4))])  # a column stays free: nothing is evicted
    wave([Request([*base[:20], 1], greedy(2))])  # reuses 20 positions of the base prompt's history
    assert checked[-1][0][0] >= 20
    for _ in range(2):
        wave(mixed(rng.randint(4, 10)))  # more than max_seqs: admissions while others finish
    assert all(new == old for new, old in checked), checked
