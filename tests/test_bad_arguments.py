"""Bad arguments across the public API: each is refused with its exact error type, the message names
the argument, and nothing observable changes (positions, live sequences, storage, the next step)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from batchkv import BatchedSequenceCache, CacheConfig, LayerSpec, from_manifest, load_manifest
from batchkv.cache import PagedDecodeCache
from batchkv.cli.workload import load_jsonl, synthetic
from batchkv.compat import DecodeGraphRunner
from batchkv.errors import (
    CapacityError,
    CheckpointError,
    ConfigError,
    ContractError,
    PositionError,
    RequestError,
    StepError,
    UnknownSequenceError,
    WorkloadError,
)
from batchkv.executor import Engine, Request, SamplingParams, SpeculativeConfig, gather
from batchkv.manifest import dump_manifest, window_pattern
from batchkv.models import SenseNovaConfig, build_model, load_checkpoint, random_init
from batchkv.models.hf import HFModel
from tests.pipeline_lm import PipelineLM
from tests.test_cache import make_pair
from tests.test_refusals import assert_same, snapshot
from tests.toy_model import ToyModel

CFG = {"num_layers": 1, "kv_heads": 2, "head_dim": 16, "max_seqs": 2, "capacity": 64}
MANIFEST = "manifests/sensenova-u1-8b-sequence.json"
NO_CUDA = not torch.cuda.is_available()
TINY_CFG = SenseNovaConfig(num_layers=1, hidden=16, q_heads=2, kv_heads=1, head_dim=8, intermediate=16, vocab=32)


def refused(call, error: type[Exception], names: str) -> Exception:
    """Run `call`; it must raise exactly `error` with `names` in its message."""
    with pytest.raises(error) as info:
        call()
    assert type(info.value) is error, f"{type(info.value).__name__} is not {error.__name__}: {info.value}"
    assert names in str(info.value), f"{names!r} not named in: {info.value}"
    return info.value


# ---- constructors: nothing exists yet, so the type and the name are what there is to check ---
CONSTRUCTORS = {
    "CacheConfig float count": (lambda: CacheConfig(**{**CFG, "num_layers": 1.0}), ConfigError, "num_layers"),
    "CacheConfig bool count": (lambda: CacheConfig(**{**CFG, "kv_heads": True}), ConfigError, "kv_heads"),
    "CacheConfig str count": (lambda: CacheConfig(**{**CFG, "capacity": "64"}), ConfigError, "capacity"),
    "CacheConfig int32 positions": (lambda: CacheConfig(**{**CFG, "capacity": 2**31}), ConfigError, "capacity"),
    "CacheConfig max_write": (lambda: CacheConfig(**CFG, max_write=1.5), ConfigError, "max_write"),
    "CacheConfig bucket": (lambda: CacheConfig(**CFG, buckets=(8, 16.0)), ConfigError, "buckets[1]"),
    "CacheConfig buckets not a sequence": (lambda: CacheConfig(**CFG, buckets=8), ConfigError, "buckets"),
    "CacheConfig tail_step": (lambda: CacheConfig(**CFG, tail_step=None), ConfigError, "tail_step"),
    "CacheConfig max_width": (lambda: CacheConfig(**CFG, max_width=2**21), ConfigError, "max_width"),
    "CacheConfig layers": (lambda: CacheConfig(**CFG, layers=LayerSpec()), ConfigError, "layers"),
    "LayerSpec window None": (lambda: LayerSpec("flat", window=None), ConfigError, "window"),
    "LayerSpec window float": (lambda: LayerSpec("ring", window=2.5), ConfigError, "window"),
    "LayerSpec policy": (lambda: LayerSpec(policy=1), ConfigError, "policy"),
    "cache config": (lambda: BatchedSequenceCache(dict(CFG)), ConfigError, "CacheConfig"),
    "cache device": (lambda: BatchedSequenceCache(CacheConfig(**CFG), "tpu9"), ConfigError, "tpu9"),
    "cache device type": (lambda: BatchedSequenceCache(CacheConfig(**CFG), 0.5), ConfigError, "0.5"),
    "manifest device": (lambda: from_manifest(MANIFEST, "tpu9"), ConfigError, "tpu9"),
    "manifest source": (lambda: from_manifest(None), ConfigError, "NoneType"),
    "load_manifest source": (lambda: load_manifest(123), ConfigError, "int"),
    "SenseNovaConfig bool": (
        lambda: SenseNovaConfig(num_layers=True, hidden=8, q_heads=1, kv_heads=1, head_dim=8, intermediate=8, vocab=8),
        ConfigError,
        "num_layers",
    ),
    "build_model device": (lambda: build_model("sensenova-u1-tiny", "tpu9"), ConfigError, "tpu9"),
    "build_model seed": (lambda: build_model("sensenova-u1-tiny", "cpu", seed=1.5), ConfigError, "seed"),
    "build_model checkpoint": (lambda: build_model("sensenova-u1-tiny", checkpoint=3), CheckpointError, "3"),
    "paged length": (lambda: PagedDecodeCache(1, 2, 16, 7.5, "cpu", torch.float32), ConfigError, "length"),
    "paged device": (lambda: PagedDecodeCache(1, 2, 16, 8, "tpu9", torch.float32), ConfigError, "tpu9"),
    "Request float id": (lambda: Request([1, 1.5]), RequestError, "prompt_ids[1]"),
    "Request bool id": (lambda: Request([True]), RequestError, "prompt_ids[0]"),
    # A list of plain ints is checked whole (min, max); anything else in it, or out of range, item by item
    "Request bool among ints": (lambda: Request([5, 6, True]), RequestError, "prompt_ids[2]"),
    "Request negative among ints": (lambda: Request([5, -1, 6]), RequestError, "prompt_ids[1] is -1"),
    "Request str prompt": (lambda: Request("hello"), RequestError, "prompt_ids"),
    "Request rope_offset": (lambda: Request([1], rope_offset=1.0), RequestError, "rope_offset"),
    # Staged as int64 every step: past the bound a submitted request would fail every later step.
    "Request rope_offset past int32": (lambda: Request([1], rope_offset=2**31), RequestError, "rope_offset"),
    "max_new_tokens": (lambda: SamplingParams(max_new_tokens=2.0), RequestError, "max_new_tokens"),
    "temperature str": (lambda: SamplingParams(temperature="hot"), RequestError, "temperature"),
    "temperature inf": (lambda: SamplingParams(temperature=float("inf")), RequestError, "temperature"),
    "top_p bool": (lambda: SamplingParams(top_p=True), RequestError, "top_p"),
    "top_k float": (lambda: SamplingParams(top_k=1.5), RequestError, "top_k"),
    "top_k past int32": (lambda: SamplingParams(top_k=2**63), RequestError, "top_k"),
    "seed float": (lambda: SamplingParams(seed=1.0), RequestError, "seed"),
    "n bool": (lambda: SamplingParams(n=True), RequestError, "n"),
    "stop id float": (lambda: SamplingParams(stop_token_ids=[2.0]), RequestError, "stop_token_ids[0]"),
    "ngram_max bool": (lambda: SpeculativeConfig("ngram", ngram_max=True), ConfigError, "ngram_max"),
    "block_size float": (lambda: SpeculativeConfig("ngram", block_size=4.0), ConfigError, "block_size"),
    "synthetic count": (lambda: synthetic(2.5, vocab_size=97), WorkloadError, "num_requests"),
    "synthetic vocab": (lambda: synthetic(2, vocab_size=97.5), WorkloadError, "vocab_size"),
    "load_jsonl fd": (lambda: load_jsonl(0), WorkloadError, "int"),
    "window_pattern": (lambda: window_pattern(4, every=1.5, window=8), ConfigError, "window_every"),
    "dump_manifest path": (lambda: dump_manifest(load_manifest(MANIFEST), 3), ConfigError, "int"),
    "random_init seed": (lambda: random_init(build_model(TINY_CFG), seed=0.5), ConfigError, "seed"),
    "checkpoint prefix": (lambda: load_checkpoint(build_model(TINY_CFG), "x", prefix=3), CheckpointError, "prefix"),
    "HFModel of a non-model": (lambda: HFModel("Qwen/Qwen3-0.6B"), ConfigError, "str"),
    "runner device": (
        lambda: DecodeGraphRunner(None, PagedDecodeCache(1, 2, 16, 8, "cpu", torch.float32), "tpu9"),
        ConfigError,
        "tpu9",
    ),
    "synthetic range": (lambda: synthetic(2, vocab_size=97, prompt_len=(1, 4.5)), WorkloadError, "prompt_len[1]"),
}
if NO_CUDA:
    CONSTRUCTORS["cache on missing CUDA"] = (
        lambda: BatchedSequenceCache(CacheConfig(**CFG), "cuda"),
        ConfigError,
        "'cuda'",
    )


@pytest.mark.parametrize("case", list(CONSTRUCTORS))
def test_a_bad_constructor_argument_is_refused_by_name(case):
    call, error, names = CONSTRUCTORS[case]
    refused(call, error, names)


# ---- cache verbs and update_and_attend: a live cache with a prepared step ---------------------
def _qkv(width=4, hq=4, kv=2, d=8, **change):
    q, k, v = torch.randn(width, hq, d), torch.randn(width, kv, d), torch.randn(width, kv, d)
    return {"q": q, "k": k, "v": v, **change}


VERBS = {
    "rewind float": (lambda c, a: c.rewind(a, 2.5), PositionError, "new_len"),
    "rewind bool": (lambda c, a: c.rewind(a, True), PositionError, "new_len"),
    "clone float": (lambda c, a: c.seq_clone(a, upto=1.0), PositionError, "upto"),
    "pos float id": (lambda c, a: c.pos(0.0), UnknownSequenceError, "0.0"),
    "seq_rm bool id": (lambda c, a: c.seq_rm(False), UnknownSequenceError, "False"),
    "declare float id": (lambda c, a: c.declare_step([a, 1.5]), UnknownSequenceError, "1.5"),
    "can_admit float": (lambda c, a: c.can_admit(a, 1.5), PositionError, "n"),
    "can_admit negative": (lambda c, a: c.can_admit(a, -1), PositionError, "n"),
    "prepare float width": (lambda c, a: c.prepare_step(4.0), StepError, "width"),
    "prepare bool width": (lambda c, a: c.prepare_step(True), StepError, "width"),
    "reserve float": (lambda c, a: c.reserve(a, 16.5), PositionError, "length"),
    "reserve unknown id": (lambda c, a: c.reserve(7, 16), UnknownSequenceError, "7"),
    "seq_new float reach": (lambda c, a: c.seq_new(reach=8.5), CapacityError, "reach"),
    "seq_new reach past capacity": (lambda c, a: c.seq_new(reach=10**6), CapacityError, "reach"),
    "clone reach below upto": (lambda c, a: c.seq_clone(a, reach=1), CapacityError, "reach"),
    "k_store bool layer": (lambda c, a: c.k_store(True), ContractError, "layer"),
    "planes past layers": (lambda c, a: c.planes(2), ContractError, "layer"),  # was an IndexError
    "planes negative layer": (lambda c, a: c.planes(-1), ContractError, "layer"),  # was the last layer's
    "planes bool layer": (lambda c, a: c.planes(True), ContractError, "layer"),
    "attend bool layer": (lambda c, a: c.update_and_attend(True, **_qkv()), ContractError, "layer"),
    "attend float layer": (lambda c, a: c.update_and_attend(0.0, **_qkv()), ContractError, "layer"),
    "attend past layers": (lambda c, a: c.update_and_attend(2, **_qkv()), ContractError, "layer"),
    "q rank": (lambda c, a: c.update_and_attend(0, **_qkv(q=torch.randn(4, 32))), ContractError, "q must"),
    "q heads": (lambda c, a: c.update_and_attend(0, **_qkv(hq=3)), ContractError, "q must"),
    "q head_dim": (lambda c, a: c.update_and_attend(0, **_qkv(q=torch.randn(4, 4, 16))), ContractError, "q must"),
    "q width": (lambda c, a: c.update_and_attend(0, **_qkv(q=torch.randn(3, 4, 8))), ContractError, "q must"),
    "q dtype": (lambda c, a: c.update_and_attend(0, **_qkv(q=torch.ones(4, 4, 8).long())), ContractError, "q must"),
    "q float64": (lambda c, a: c.update_and_attend(0, **_qkv(q=torch.ones(4, 4, 8).double())), ContractError, "q"),
    "k shape": (lambda c, a: c.update_and_attend(0, **_qkv(k=torch.randn(4, 1, 8))), ContractError, "k must"),
    "v head_dim": (lambda c, a: c.update_and_attend(0, **_qkv(v=torch.randn(4, 2, 4))), ContractError, "v must"),
    "k dtype": (
        lambda c, a: c.update_and_attend(0, **_qkv(k=torch.ones(4, 2, 8).int())),
        ContractError,
        "k torch.int32",
    ),
    # Every backend refuses what the Triton write cannot load, so code that runs on the CPU runs on CUDA.
    "k float64": (
        lambda c, a: c.update_and_attend(0, **_qkv(k=torch.ones(4, 2, 8).double())),
        ContractError,
        "k torch.float64",
    ),
    "v e4m3": (
        lambda c, a: c.update_and_attend(0, **_qkv(v=torch.ones(4, 2, 8).to(torch.float8_e4m3fn))),
        ContractError,
        "v torch.float8_e4m3fn",
    ),
    "k device": (
        lambda c, a: c.update_and_attend(0, **_qkv(k=torch.empty(4, 2, 8, device="meta"))),
        ContractError,
        "k is on meta",
    ),
    "q not a tensor": (lambda c, a: c.update_and_attend(0, **_qkv(q=[[0.0]])), ContractError, "q is a list"),
    "q strided": (
        lambda c, a: c.update_and_attend(0, **_qkv(q=torch.randn(4, 8, 4).transpose(1, 2))),
        ContractError,
        "q needs a contiguous",
    ),
    "scale str": (lambda c, a: c.update_and_attend(0, **_qkv(), scale="0.1"), ContractError, "scale"),
    "causal int": (lambda c, a: c.update_and_attend(0, **_qkv(), causal=1), ContractError, "causal"),
}


def test_bad_cache_arguments_change_nothing_and_the_next_step_matches_the_oracle():
    pair = make_pair(max_seqs=3, capacity=32)
    cache = pair.cache
    a, b = pair.new(), pair.new()
    pair.step([a, a, a, b])
    pair.step([a, b])
    cache.declare_step([a, b, b])
    cache.prepare_step(4)  # a standing, prepared step: every refusal below must leave it staged
    for case, (call, error, names) in VERBS.items():
        before = snapshot(cache)
        try:
            refused(lambda call=call: call(cache, a), error, names)
        except AssertionError as exc:
            raise AssertionError(f"{case}: {exc}") from None
        assert_same(before, snapshot(cache))
    # The standing step still runs, and matches the oracle (which never saw the refusals).
    cache.declare_step([a, b, b])  # the same declaration again, driven through the oracle
    pair.step([a, b, b], width=4)
    assert cache.sequences == [a, b] and (cache.pos(a), cache.pos(b)) == (5, 4)


def test_lengths_given_as_numpy_integers_are_held_as_python_ints():
    pair = make_pair(max_seqs=3, capacity=32)
    cache = pair.cache
    a = pair.new()
    pair.step([a, a, a])
    b = cache.seq_clone(a, upto=np.int64(3))
    cache.rewind(a, np.int32(2))
    assert [type(cache.pos(s)) for s in (a, b)] == [int, int] and (cache.pos(a), cache.pos(b)) == (2, 3)


def test_a_paged_cache_refuses_bad_lengths_and_shapes_and_attends_as_before():
    paged = PagedDecodeCache(1, 2, 16, 8, "cpu", torch.float32, attention="reference")
    twin = PagedDecodeCache(1, 2, 16, 8, "cpu", torch.float32, attention="reference")
    gen = torch.Generator().manual_seed(0)
    qkv = [torch.randn(1, h, 1, 16, generator=gen) for h in (4, 2, 2)]
    for c in (paged, twin):
        for n in range(1, 6):  # positions 0..4 written
            c.set_length(n)
            c.attend(0, *qkv, 0.25)
        c.set_length(6)
    state = (paged.length, paged.bucket, paged.generation, paged.inner.positions.clone())
    stores = [t.clone().view(torch.int32) for t in (*paged.k, *paged.v)]  # bits: unwritten rows may hold NaN
    for call, error, names in (
        (lambda: paged.set_length(7.5), PositionError, "n"),
        (lambda: paged.set_length(True), PositionError, "n"),
        (lambda: paged.grow(4096.0), PositionError, "length"),
        (lambda: paged.attend(0, torch.randn(1, 4, 2, 16), *qkv[1:], 0.25), ContractError, "query"),
        (lambda: paged.attend(0, qkv[0], torch.randn(1, 2, 1, 8), qkv[2], 0.25), ContractError, "key"),
        (lambda: paged.attend(0, torch.randn(1, 4, 1, 8), *qkv[1:], 0.25), ContractError, "[1, 4, 1, 8]"),  # D 8 of 16
    ):
        refused(call, error, names)
        assert (paged.length, paged.bucket, paged.generation) == state[:3]
        assert torch.equal(paged.inner.positions, state[3])
        assert all(torch.equal(t.view(torch.int32), b) for t, b in zip((*paged.k, *paged.v), stores, strict=True))
    assert torch.equal(paged.attend(0, *qkv, 0.25), twin.attend(0, *qkv, 0.25))


def test_the_decode_runner_refuses_a_fractional_token_or_rope_index_before_writing_it():
    paged = PagedDecodeCache(3, 2, 16, 8, "cpu", torch.float32, attention="reference")
    runner = DecodeGraphRunner(PipelineLM().eval(), paged, "cpu")
    paged.set_length(1)
    for args, names in (((1.5, 0), "token"), ((3, True), "t_index"), ((-1, 0), "token")):
        refused(lambda args=args: runner.step(*args), ContractError, names)
        assert runner.input_ids.tolist() == [[0]] and runner.indexes.tolist() == [[0], [0], [0]]
    assert runner.step(3, 0).shape == (1, 1, 61)


# ---- the engine: refusals leave a running engine as it was -----------------------------------
def _engine(**overrides) -> Engine:
    options = {"max_seqs": 2, "capacity": 48, "max_step_tokens": 8, "prefill_chunk": 4, **overrides}
    return Engine(ToyModel(seed=3), **options)


ENGINE = {
    "max_seqs float": ({"max_seqs": 2.0}, "max_seqs"),
    "capacity bool": ({"capacity": True}, "capacity"),
    "max_step_tokens absurd": ({"max_step_tokens": 2**21, "prefill_chunk": 4}, "max_step_tokens"),
    "prefill_chunk float": ({"prefill_chunk": 1.5}, "prefill_chunk"),
    "width_buckets entry": ({"width_buckets": (1, 2.5, 8)}, "width_buckets[1]"),
    "width_buckets empty": ({"width_buckets": ()}, "width_buckets"),
    "device": ({"device": "tpu9"}, "tpu9"),
    "use_graphs int": ({"use_graphs": 1}, "use_graphs"),
    "seed float": ({"seed": 0.5}, "seed"),
    "row_buckets entry": ({"row_buckets": [8.0]}, "row_buckets[0]"),
    "row_step negative": ({"row_step": -1}, "row_step"),
    "overlap int": ({"overlap": 1}, "overlap"),  # 1 == True, but it used to turn overlap off
    "overlap float": ({"overlap": 0.0}, "overlap"),
    "prefill_budget bool": ({"prefill_budget": True}, "prefill_budget"),
    "prefill_budget float": ({"prefill_budget": 4.0}, "prefill_budget"),
}


def test_numpy_integers_pass_wherever_a_count_is_taken():
    engine = _engine(prefill_budget=np.int64(3))
    assert engine.scheduler.prefill_budget == 3 and type(engine.scheduler.prefill_budget) is int
    spec = SpeculativeConfig("ngram", block_size=np.int64(4), ngram_max=np.int32(2))
    assert (spec.block_size, spec.ngram_max) == (4, 2) and type(spec.block_size) is int


def test_the_largest_top_k_and_rope_offset_are_served_like_their_meaning():
    """top_k 2^31 - 1 keeps every token (as 0 does) and rope_offset 2^31 - 1 decodes: both stage
    into the step's int64 inputs without overflowing."""
    prompt, draw = [5, 6, 7], {"max_new_tokens": 5, "temperature": 0.9, "seed": 3}
    outputs = []
    for top_k in (0, 2**31 - 1):
        engine = _engine()
        rid = engine.submit(Request(prompt, SamplingParams(top_k=top_k, **draw)))
        outputs.append(gather(engine.run_until_done())[rid].tokens)
    assert outputs[0] == outputs[1]
    engine = _engine()
    rid = engine.submit(Request(prompt, SamplingParams(max_new_tokens=5), rope_offset=2**31 - 1))
    assert gather(engine.run_until_done())[rid].finish_reasons == ["length"]


@pytest.mark.parametrize("case", list(ENGINE))
def test_a_bad_engine_option_is_refused_by_name(case):
    overrides, names = ENGINE[case]
    refused(lambda: _engine(**overrides), ConfigError, names)


def test_refused_submits_leave_a_running_engine_producing_the_same_tokens():
    request = Request([5, 6, 7, 8, 9], SamplingParams(max_new_tokens=6))
    calm, busy = _engine(), _engine()
    for engine in (calm, busy):
        engine.submit(request)
        engine.step()
    state = (
        busy.num_waiting,
        busy.num_running,
        busy.cache.sequences,
        [busy.cache.pos(s) for s in busy.cache.sequences],
    )
    for bad in ("not a request", Request([1, 2, 96 + 5]), Request([1] * 48)):
        with pytest.raises(RequestError):
            busy.submit(bad)
        assert (busy.num_waiting, busy.num_running, busy.cache.sequences) == state[:3]
        assert [busy.cache.pos(s) for s in busy.cache.sequences] == state[3]
    refused(lambda: busy.cancel(True), RequestError, "request_id")  # True == 1 would cancel request 1
    refused(lambda: busy.cancel(0.0), RequestError, "request_id")
    assert gather(busy.run_until_done()) == gather(calm.run_until_done())
    assert (busy.metrics.refused, busy.metrics.submitted) == (2, 1)  # the non-Request is not a request
