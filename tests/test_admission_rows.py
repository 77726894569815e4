"""Rows at admission under a fixed store (`kv_positions`): a request with n > 1 is admitted only
when the rows of its forks are free too, and nothing admitted after it takes them, so no fork ever
meets a full store. With the prefix cache the request may adopt a cached history taller than its
own reach: the adopted column counts as one sample's rows, the forks are as tall as the request's
reach (what admission held back), and when even that cannot fit the history is dropped and the
prompt recomputed rather than waited on forever. Tokens against the recomputing oracle."""

from __future__ import annotations

import random

import pytest

from batchkv.executor import Engine, Request, gather
from tests.executor_helpers import greedy, oracle, random_prompt, working
from tests.toy_model import ToyModel

CAPACITY = 80


@pytest.fixture(scope="module")
def model():
    return ToyModel(seed=0)


def engine(model, kv_positions: int, prefix_cache: bool = True) -> Engine:
    return Engine(model, max_seqs=4, capacity=CAPACITY, max_step_tokens=32, prefill_chunk=8,
                  prefix_cache=prefix_cache, kv_positions=kv_positions)  # fmt: skip


def assert_oracle(model, outputs, rid: int, request: Request) -> None:
    want = oracle(model, Request(request.prompt_ids, greedy(request.params.max_new_tokens)), CAPACITY)
    for tokens, finish in zip(outputs[rid].tokens, outputs[rid].finish_reasons, strict=True):
        assert (tokens, finish) == want  # greedy: every sample decodes the same tokens


def tall_history(model, e: Engine) -> tuple[list[int], int]:
    """Leave a cached history in `e` whose extent is far taller than what it wrote: a request that
    could reach 79 positions stops after 5 tokens (24 written). Returns prompt + tokens, its column."""
    prompt = random_prompt(random.Random(0), 20, 20)
    full, _ = oracle(model, Request(prompt, greedy(60)), CAPACITY)
    stop = full[4]
    assert stop not in full[:4]
    rid = e.submit(Request(prompt, greedy(60, stop_token_ids=(stop,))))
    out = gather(e.run_until_done())[rid]
    assert out.tokens[0] == full[:5]
    (history,) = e.scheduler.prefix.cached
    assert e.cache.reach(history.seq) == 79 and e.cache.pos(history.seq) == 24
    return prompt + full[:5], history.seq


def test_the_forks_of_an_adopted_tall_history_take_the_requests_reach_not_the_historys(model):
    # 119 positions: the 79-row history leaves 40 free, enough for a fork of reach 34 (not of 79)
    e = engine(model, kv_positions=119)
    prompt, _ = tall_history(model, e)
    request = Request(prompt, greedy(10, n=2))  # reach 25 + 10 - 1 = 34 per sample
    rid = e.submit(request)
    outputs = gather(e.run_until_done())
    assert_oracle(model, outputs, rid, request)
    assert e.metrics.prefix_reused == len(prompt) - 1  # the history was adopted, not recomputed
    e.assert_idle()


def test_an_n_sample_request_adopting_a_tall_history_waits_for_its_forks_rows_under_a_full_store(model):
    # The tall history (79 rows) and a running request (29) leave 11 of 119 free: the n = 2 request
    # that adopts the history needs 34 more for its fork, so it waits for the runner, then fits.
    e = engine(model, kv_positions=119)
    prompt, _ = tall_history(model, e)
    runner = Request(random_prompt(random.Random(1), 10, 10), greedy(20))
    request = Request(prompt, greedy(10, n=2))
    ids, events = [e.submit(runner)], []
    for _ in range(3):
        events += e.step()  # the runner is admitted and prefilling
    assert e.cache.free_rows == 119 - 79 - 29
    ids.append(e.submit(request))
    generation = e.cache.generation
    for _ in working(e):
        events += e.step()  # a fork that met a full store would raise CapacityError here
    outputs = gather(events)
    assert_oracle(model, outputs, ids[0], runner)
    assert_oracle(model, outputs, ids[1], request)
    assert e.cache.generation == generation and e.metrics.prefix_reused == len(prompt) - 1
    e.assert_idle()


def test_an_n_sample_request_that_cannot_fit_beside_its_cached_history_drops_it_and_recomputes(model):
    # 99 positions: the 79-row history leaves 20, and the request's fork needs 34 with nothing else
    # running to free rows: waiting would never end, so the history goes and the prompt is computed.
    e = engine(model, kv_positions=99)
    prompt, _ = tall_history(model, e)
    request = Request(prompt, greedy(10, n=2))
    rid = e.submit(request)
    outputs = gather(e.run_until_done())  # StepError "no step could be planned" if it waited
    assert_oracle(model, outputs, rid, request)
    assert e.metrics.prefix_evictions == 1 and e.metrics.prefix_reused == 0
    e.assert_idle()


def test_a_later_request_does_not_take_the_rows_held_back_for_a_prompts_forks(model):
    # 88 positions: an n = 2 request of reach 39 holds 78 (its fork's 39 held back while its prompt
    # prefills); a later request of reach 19 must wait for 19 free rows instead of taking the fork's.
    e = engine(model, kv_positions=88, prefix_cache=False)
    rng = random.Random(2)
    forked = Request(random_prompt(rng, 30, 30), greedy(10, n=2))
    later = Request(random_prompt(rng, 10, 10), greedy(10))
    ids, events = [e.submit(forked)], e.step()  # admitted: the first 8 of 30 prompt tokens
    assert e.scheduler.prefilling and e.scheduler.prefilling[0].spare == 1
    ids.append(e.submit(later))
    events += e.step()
    assert e.num_waiting == 1  # 49 rows are free, but 39 of them are the fork's
    for _ in working(e):
        events += e.step()
    outputs = gather(events)
    assert_oracle(model, outputs, ids[0], forked)
    assert_oracle(model, outputs, ids[1], later)
    e.assert_idle()


def test_admitting_a_burst_does_work_linear_in_the_burst_and_keeps_priority_order(model, monkeypatch):
    # What holds rows back is summed over the requests that still hold rows for forks (n > 1), not
    # over every prompt in flight, and the queue is kept in admission order instead of sorted each
    # step: counted in `horizon` calls (each fork-holding request costs one per check).
    from batchkv.executor.admission import Admission
    from batchkv.executor.request import SamplingParams

    e = Engine(model, max_seqs=512, capacity=16, max_step_tokens=512, prefill_chunk=8, prefix_cache=False)
    calls = []
    horizon = Admission.horizon
    monkeypatch.setattr(Admission, "horizon", lambda self, state: calls.append(1) or horizon(self, state))
    params = SamplingParams(max_new_tokens=4)
    ids = [e.submit(Request([i % 50 + 1, 2, 3], params, priority=i % 3)) for i in range(300)]
    ids.append(e.submit(Request([7, 8, 9], SamplingParams(max_new_tokens=4, n=3), priority=-1)))
    order = [state.id for state in e.scheduler.waiting]
    assert order == [ids[-1]] + [ids[i] for level in range(3) for i in range(300) if i % 3 == level]
    calls.clear()
    e.scheduler.admit()
    assert len(e.scheduler.prefilling) == 301 and not e.scheduler.waiting
    # one per admitted request, and the n = 3 request's in the two room checks of each admission
    # (summed over every prompt in flight instead, 301 admissions would cost about 90,000)
    assert len(calls) <= 4 * 301 + 1
