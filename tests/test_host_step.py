"""The engine's host step as array work: what changed to make it so, each against what it replaced.

- A steady `Engine.step()` enters the same Python functions whatever the rows it decodes (sampled
  and greedy rows alike): nothing is called once per row (on 3e02462 the runner asked each row's
  request whether it adjusts sampling and hashed each sampled row's draw in Python).
- The runner stages sampling parameters and draws from the scheduler's slot table
  (`rows.stage_sampling`); the row-by-row staging it replaced is kept for plans without a table and
  is the oracle here, on every step of a mixed workload.
- `uniforms` (the draws as arrays) against `uniform` (the scalar splitmix64 hash).
- `begin_step` (the cache's one verb for a step) against `declare_step` + `prepare_step`: the
  same staged buffers, and a refusal that changes nothing.
- `OneEach` (a plain step's tokens as one array) reads as the list of one-token lists it replaced.
- `Event` stored as a tuple keeps the frozen dataclass's fields, defaults, equality, hash, repr,
  `dataclasses` view and pickling; `events` (a step's built in bulk) equals `Event(...)` per row.
- `begin_step` reuses the last declaration when a step declares the same ids (a steady decode
  step), and stages and refuses exactly as a cache that rebuilds it every step.
- On the CPU, `Staging.upload` copies through NumPy views: the same elements as torch's copy_.
- A plan's decode rows keep the arrays their lists were made from (`StepPlan.ints`), read only
  while the list is the one made and unchanged in length; the staged inputs equal the lists', a
  pending token (overlap) staged from the previous launch's tokens on the CPU (no device gather).
- `greedy_tokens` on the CPU (NumPy's argmax) against torch's argmax: ties, NaN, infinities.
"""

from __future__ import annotations

import dataclasses
import pickle
import random
from dataclasses import replace

import numpy as np
import pytest
import torch

from batchkv import BatchedSequenceCache, CacheConfig
from batchkv.cache import LayerSpec
from batchkv.cache.staging import Staging
from batchkv.cache.step import Declaration
from batchkv.errors import StepError, UnknownSequenceError
from batchkv.executor import Engine, Request, SamplingParams, runner
from batchkv.executor.pipeline import OneEach
from batchkv.executor.request import Event, Logprobs, events
from batchkv.executor.rows import stage_sampling
from batchkv.executor.sampling import greedy_tokens, uniform, uniforms
from batchkv.executor.state import StepPlan
from tests.executor_helpers import package_calls
from tests.toy_model import ToyModel

VOCAB = 32


class NoOpModel:
    """A `StepModel` whose forward costs nothing: fixed logits [rows, vocab], the cache untouched."""

    vocab_size = VOCAB
    max_positions = 4096
    device = torch.device("cpu")

    def __init__(self) -> None:
        self._logits = torch.linspace(0.0, 1.0, VOCAB).repeat(1024, 1)

    def cache_spec(self) -> dict:
        return {"num_layers": 1, "kv_heads": 1, "head_dim": 16, "dtype": torch.float32}

    def __call__(self, input_ids, indexes, cache, logits_rows) -> torch.Tensor:
        return self._logits[: logits_rows.shape[0]]


def _params(i: int, max_new: int) -> SamplingParams:
    """Every third row greedy, the others sampled with their own seed, temperature, top-k and top-p."""
    if i % 3 == 0:
        return SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    return SamplingParams(max_new_tokens=max_new, ignore_eos=True, temperature=0.5 + 0.1 * (i % 5),
                          top_k=i % 7, top_p=0.8 if i % 2 else 1.0, seed=1000 + i)  # fmt: skip


def _steady_step_calls(rows: int, prefix_cache: bool) -> int:
    """Python functions of the package entered by one steady decode step of `rows` samples."""
    engine = Engine(NoOpModel(), max_seqs=rows, capacity=64, max_step_tokens=max(64, 4 * rows), prefill_chunk=4,
                    use_graphs=False, overlap=False, prefix_cache=prefix_cache, device="cpu")  # fmt: skip
    for i in range(rows):
        engine.submit(Request([(5 * i + j) % VOCAB for j in range(3)] + [i % VOCAB], _params(i, 40)))
    for _ in range(4):  # admission, the prompts, the first decode steps
        engine.step()
    assert engine.num_running == rows and engine.num_waiting == 0
    events, calls = package_calls(engine.step)
    assert len(events) == rows  # a steady step: one token for every sample
    engine.close()
    return calls


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_a_steady_engine_step_enters_the_same_python_functions_at_4_and_at_64_rows(prefix_cache):
    assert _steady_step_calls(4, prefix_cache) == _steady_step_calls(64, prefix_cache)


def test_sampling_staged_from_the_slot_table_equals_staging_row_by_row_on_every_step(monkeypatch):
    staged = []
    real = stage_sampling

    def both(batch, params, top_k):  # the table's arrays, then the row-by-row oracle on copies
        sampling = real(batch, params, top_k)
        assert batch.table is not None
        want_params, want_top_k = np.full_like(params, 0.0), np.zeros_like(top_k)
        want_params[1] = 1.0
        assert real(replace(batch, table=None), want_params, want_top_k) == sampling
        assert np.array_equal(params, want_params) and np.array_equal(top_k, want_top_k)
        staged.append(len(batch.rows))
        return sampling

    rng = random.Random(3)
    engine = Engine(ToyModel(seed=0), max_seqs=6, capacity=96, max_step_tokens=32, prefill_chunk=8, device="cpu",
                    use_graphs=False, overlap=True)  # fmt: skip
    monkeypatch.setattr(runner, "stage_sampling", both)
    for i in range(10):  # prompts of several chunks, n > 1 forks, greedy and sampled, queued behind full columns
        params = replace(_params(i, rng.randint(2, 12)), n=1 + (i % 4 == 1))
        engine.submit(Request([rng.randrange(97) for _ in range(rng.randint(3, 20))], params))
    events = engine.run_until_done()
    engine.assert_idle()
    assert len(staged) > 10 and max(staged) > 1 and sum(e.finish_reason == "length" for e in events) == 13  # 3 of n=2


def test_uniforms_equal_the_scalar_hash_for_every_seed_sample_and_index():
    rng = random.Random(7)
    seeds = [0, 1, 2**63 - 1, 2**64 - 1] + [rng.getrandbits(64) for _ in range(500)]
    samples = [rng.randrange(8) for _ in seeds]
    indexes = [rng.randrange(1 << 20) for _ in seeds]
    got = uniforms(np.array(seeds, dtype=np.uint64), np.array(samples), np.array(indexes))
    assert got.tolist() == [uniform(*row) for row in zip(seeds, samples, indexes, strict=True)]


def _cache() -> BatchedSequenceCache:
    layers = (LayerSpec("flat"), LayerSpec("ring", window=6))
    cfg = CacheConfig(num_layers=2, kv_heads=1, head_dim=8, max_seqs=4, capacity=64, max_write=8,
                      dtype=torch.float32, max_width=16, layers=layers)  # fmt: skip
    return BatchedSequenceCache(cfg, "cpu", attention="reference")


def _staged(cache: BatchedSequenceCache) -> list:
    buffers = cache._buffers
    return [buffers.positions.clone(), buffers.slots.clone(), buffers.seq_info.clone(), cache.prepared]


def test_begin_step_stages_what_declare_then_prepare_stage():
    one, two = _cache(), _cache()
    for cache in (one, two):
        a, b = cache.seq_new(), cache.seq_new(reach=40)
    for ids, width in (([a, a, a, b], 4), ([b, a], 8), ([a] * 8 + [b] * 3, 16), ([b, a, b], 4)):
        one.begin_step(ids, width)
        two.declare_step(ids)
        two.prepare_step(width)
        for x, y in zip(_staged(one), _staged(two), strict=True):
            assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
        one.commit_step()
        two.commit_step()
        assert one._lengths == two._lengths and one.reach(a) == two.reach(a)


@pytest.mark.parametrize(
    ("ids", "width", "error"),
    [([0, 0], 1, StepError), ([0, 0], 17, StepError), ([0, 3], 2, UnknownSequenceError), ([], 1, StepError)],
)
def test_a_refused_begin_step_leaves_the_previous_step_standing(ids, width, error):
    cache = _cache()
    a = cache.seq_new()
    cache.seq_new()
    cache.begin_step([a, a, 1], 4)
    before = _staged(cache)
    with pytest.raises(error):
        cache.begin_step(ids, width)
    for x, y in zip(before, _staged(cache), strict=True):
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
    cache.commit_step()  # the standing step commits as it was declared
    assert cache._lengths == {a: 2, 1: 1}


def test_one_each_reads_as_the_list_of_one_token_lists_it_replaced():
    runs = OneEach(np.array([5, 0, 31], dtype=np.int64))
    lists = [[5], [0], [31]]
    assert runs == lists and lists == list(runs) and len(runs) == 3
    assert runs[1] == [0] and runs[-1] == [31] and runs[1:] == [[0], [31]]
    assert all(type(token) is int for run in runs for token in run)
    assert runs != [[5], [0], [30]] and runs == OneEach(np.array([5, 0, 31]))


def test_an_event_keeps_the_fields_defaults_equality_hash_repr_and_dataclass_view_of_a_frozen_dataclass():
    lp = Logprobs(4, -0.5, ((4, -0.5),))
    event = Event(3, 4, "stop", 1, lp)
    assert (event.request_id, event.token, event.finish_reason, event.sample, event.logprobs) == (3, 4, "stop", 1, lp)
    assert event.prompt_logprobs is None and Event(0, None) == Event(request_id=0, token=None, finish_reason=None)
    assert Event(0, 1).sample == 0 and Event(0, 1).logprobs is None
    assert event == Event(3, 4, "stop", 1, lp) and event != Event(3, 4, "length", 1, lp)
    assert hash(event) == hash(Event(3, 4, "stop", 1, lp)) and len({event, Event(3, 4, "stop", 1, lp)}) == 1
    assert repr(Event(1, 2)) == (
        "Event(request_id=1, token=2, finish_reason=None, sample=0, logprobs=None, prompt_logprobs=None)"
    )
    assert [f.name for f in dataclasses.fields(Event)] == [
        "request_id", "token", "finish_reason", "sample", "logprobs", "prompt_logprobs"
    ]  # fmt: skip
    assert dataclasses.is_dataclass(event) and dataclasses.asdict(Event(1, 2))["finish_reason"] is None
    timed_out = replace(event, finish_reason="timeout")  # what the server does to a stream that timed out
    assert type(timed_out) is Event and timed_out.finish_reason == "timeout" and timed_out.logprobs is lp
    with pytest.raises(dataclasses.FrozenInstanceError):
        event.token = 5  # type: ignore[misc]
    with pytest.raises(TypeError):
        Event(1)  # type: ignore[call-arg]
    copied = pickle.loads(pickle.dumps(event))
    assert type(copied) is Event and copied == event


def test_events_built_in_bulk_equal_events_made_one_by_one():
    lp = Logprobs(7, -1.0)
    rows = ([1, 2, 2], [7, 8, 9], [None, "length", None], [0, 0, 1], [lp, None, None])
    made = events(*rows)
    assert made == [Event(*row) for row in zip(*rows, strict=True)]
    assert all(type(event) is Event for event in made) and made[1].finish_reason == "length"
    with pytest.raises(ValueError):
        events([1], [2, 3], [None], [0], [None])


def _steps(cache: BatchedSequenceCache, twin: BatchedSequenceCache, steps: list[tuple[object, int]]) -> None:
    """Begin and commit each step on `cache` and on `twin`, which rebuilds every declaration; the
    staged buffers and lengths agree after each."""
    for ids, width in steps:
        twin._last = None
        for c in (cache, twin):
            c.begin_step(ids, width)
        for x, y in zip(_staged(cache), _staged(twin), strict=True):
            assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
        for c in (cache, twin):
            c.commit_step()
        assert cache._lengths == twin._lengths


def test_a_step_that_declares_the_last_ones_ids_reuses_its_declaration_and_stages_the_same(monkeypatch):
    cache, twin = _cache(), _cache()
    for c in (cache, twin):
        a, b = c.seq_new(reach=40), c.seq_new(reach=40)
    made = []
    real = Declaration.from_ids.__func__

    def counted(cls, seq_ids):
        made.append(list(seq_ids))
        return real(cls, seq_ids)

    monkeypatch.setattr(Declaration, "from_ids", classmethod(counted))
    ids = np.array([a, b], dtype=np.int64)
    steady = [(ids, 2), ([a, b], 2), (np.array([a, b], dtype=np.int32), 4)]
    _steps(cache, twin, steady)
    assert made.count([a, b]) == 1 + len(steady)  # this cache made it once; the twin every step
    ids[:] = [b, a]  # the caller writes its array again: compared with a copy, not the array kept
    _steps(cache, twin, [(ids, 2), ([b, b, a], 4), ([b, b, a], 4)])
    assert made.count([b, a]) == 2 and made.count([b, b, a]) == 3


@pytest.mark.parametrize("bad", ["freed", "float"])
def test_a_reused_declaration_still_refuses_a_freed_sequence_or_ids_that_are_not_integers(bad):
    cache = _cache()
    a, b = cache.seq_new(), cache.seq_new()
    cache.begin_step([a, b], 2)
    cache.commit_step()
    if bad == "freed":
        cache.seq_rm(b)
    before = _staged(cache)
    with pytest.raises(UnknownSequenceError):
        cache.begin_step([a, b] if bad == "freed" else np.array([a, b], dtype=np.float64), 2)
    for x, y in zip(before, _staged(cache), strict=True):
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y


def test_the_cpu_upload_copies_the_elements_torchs_copy_does():
    sizes = {torch.int64: 40, torch.int32: 24, torch.float32: 12}
    numpy_path, torch_path = Staging(sizes, torch.device("cpu")), Staging(sizes, torch.device("cpu"))
    torch_path._device_views = None  # the device path: torch slices and copy_
    rng = np.random.default_rng(5)
    for spans in ({torch.int64: [(3, 9), (8, 15), (30, 40)], torch.int32: [(0, 24)]}, {torch.float32: [(5, 5)]}, None):
        for staging in (numpy_path, torch_path):
            for view in staging.begin().values():
                view[:] = rng.integers(-99, 99, view.size)
        for dtype in sizes:  # the same host values in both
            torch_path.begin()[dtype][:] = numpy_path.peek()[dtype]
        assert numpy_path.upload(spans) == torch_path.upload(spans)
        for dtype in sizes:
            assert torch.equal(numpy_path.device_buffers[dtype], torch_path.device_buffers[dtype])


def test_a_plan_reads_the_array_its_list_was_made_from_only_while_the_list_is_unchanged():
    plan = StepPlan()
    array = np.array([4, 5, 6], dtype=np.int64)
    plan.seq_ids = array.tolist()
    plan.arrays["seq_ids"] = (plan.seq_ids, array)
    assert plan.ints("seq_ids") is array
    plan.add(9, [1, 2], [0, 1])  # a prompt chunk after the decode rows: extended in place
    assert plan.ints("seq_ids").tolist() == [4, 5, 6, 9, 9] and plan.ints("input_ids").tolist() == [1, 2]
    plan.seq_ids = [7, 8, 9]  # replaced (as the speculator does) by a list of the same length
    assert plan.ints("seq_ids").tolist() == [7, 8, 9] and plan.ints("seq_ids").dtype == np.int64


def test_every_staged_input_of_an_engine_step_equals_its_plans_lists(monkeypatch):
    seen = []
    real = runner.ModelRunner._stage

    def both(self, batch, width, previous):
        out = real(self, batch, width, previous)
        n, rows = len(batch.seq_ids), len(batch.rows)
        staged = self._staging.peek()[torch.int64]
        inputs = staged[2 * self.rows : 2 * self.rows + 5 * width].reshape(5, width)
        # on the CPU a pending token is staged from the previous launch's tokens, read on the host
        pending = [previous.read()[s][0] if s >= 0 else -1 for s in batch.token_src] if batch.token_src else []
        ids = [p if p >= 0 else token for p, token in zip(pending, batch.input_ids, strict=False)]
        assert inputs[0, :n].tolist() == ids + batch.input_ids[len(ids) :]
        assert inputs[1, :n].tolist() == batch.t_index and (inputs[4, :n] == -1).all() and not self._gather
        assert staged[:rows].tolist() == batch.rows
        assert self.cache._declaration.seqs.tolist() == [k for i, k in enumerate(batch.seq_ids)
                                                          if i == 0 or batch.seq_ids[i - 1] != k]  # fmt: skip
        seen.append((n, bool(batch.arrays), bool(batch.token_src)))
        return out

    monkeypatch.setattr(runner.ModelRunner, "_stage", both)
    for overlap in (False, True):
        engine = Engine(ToyModel(), max_seqs=8, capacity=64, use_graphs=False, overlap=overlap, prefill_chunk=4)
        for i in range(6):  # prompts of 3 to 8 tokens: prompt chunks beside decode rows, then decode alone
            engine.submit(Request([(i + j) % 97 for j in range(3 + i)], SamplingParams(max_new_tokens=5 + i)))
        engine.run_until_done()
        engine.close()
    assert any(kept and n > 1 for n, kept, _ in seen) and any(src for _, _, src in seen)


@pytest.mark.parametrize("overlap", [False, True])
def test_steady_engine_steps_make_no_declaration_until_the_running_samples_change(monkeypatch, overlap):
    engine = Engine(NoOpModel(), max_seqs=8, capacity=64, prefill_chunk=4, use_graphs=False, overlap=overlap,
                    device="cpu")  # fmt: skip
    for i in range(4):
        engine.submit(Request([1 + i, 2, 3], _params(i, 30)))
    for _ in range(4):  # admission, the prompts, the first decode steps
        engine.step()
    made = []
    real = Declaration.from_ids.__func__
    monkeypatch.setattr(Declaration, "from_ids", classmethod(lambda cls, ids: made.append(1) or real(cls, ids)))
    for _ in range(5):
        assert len(engine.step()) == 4
    assert made == []  # the same samples decode: each step reuses the last declaration
    engine.submit(Request([5, 6], _params(4, 30)))
    engine.step()  # its prompt joins the step: a new declaration
    assert made == [1]
    engine.close()


@pytest.mark.parametrize("case", ["steady", "mixed"])
def test_a_finished_steps_gaps_and_first_token_times_equal_those_computed_row_by_row(case):
    from types import SimpleNamespace

    from batchkv.executor.metrics import Metrics

    now, slots = 10.0, np.array([3, 0, 2, 1], dtype=np.int64)
    read = np.array([4, 2, 7, 1]) if case == "steady" else np.array([4, 0, 0, 1])
    emit = np.array([9.5, 9.5, 9.5, 9.5]) if case == "steady" else np.array([9.5, 0.0, 0.0, 8.25])
    got = np.array([1, 1, 1, 1]) if case == "steady" else np.array([1, 1, 2, 1])
    table = SimpleNamespace(read=np.zeros(4, dtype=np.int64), index=np.array([0, 1, 0, 0]),
                            submitted=np.array([1.0, 2.0, 3.0, 4.0]))  # fmt: skip
    table.read[slots] = read + got
    metrics = Metrics(max_seqs=4)
    metrics.observe_finish(now, table, slots, read, emit, ["length"])
    rows = range(len(slots))
    assert metrics.inter_token == [now - emit[i] for i in rows if got[i] > 0 and read[i] > 0]
    assert metrics.first_token == [
        now - table.submitted[slots[i]] for i in rows if got[i] > 0 and read[i] == 0 and table.index[slots[i]] == 0
    ]
    assert metrics.generated_tokens == got.sum() and metrics.finished == {"length": 1}
    assert (metrics.first_token != []) == (case == "mixed")


def test_greedy_tokens_on_the_cpu_pick_what_torchs_argmax_picks_on_ties_nan_and_infinities():
    logits = torch.randint(0, 3, (300, 17), generator=torch.Generator().manual_seed(0)).float()  # many ties
    logits[3, 5] = logits[6, 1] = logits[6, 7] = float("nan")
    logits[4] = float("-inf")
    logits[5, 2] = float("inf")
    for chosen in (logits, logits[10:40], logits[:, :9], logits.t().contiguous().t()[:50]):
        picked = greedy_tokens(chosen)
        assert picked.dtype == torch.int64 and torch.equal(picked, chosen.argmax(-1))
    assert greedy_tokens(logits)[3:7].tolist() == [5, 0, 2, 1]
