"""An engine's memory goes when it is closed or dropped: no reference cycle holds it until a gc pass."""

from __future__ import annotations

import gc
import weakref

import pytest

from batchkv.errors import StepError
from batchkv.executor import Engine, Request, SamplingParams, SpeculativeConfig
from tests.toy_model import ToyModel


def served(**kw) -> Engine:
    engine = Engine(ToyModel(seed=0), max_seqs=4, capacity=64, max_step_tokens=16, prefill_chunk=8, **kw)
    engine.submit(Request([1, 2, 3, 1, 2, 3], SamplingParams(max_new_tokens=5)))
    engine.run_until_done()
    return engine


def storage_refs(engine: Engine) -> list[weakref.ref]:
    """Weak references to every storage plane and the runner's output buffer (logits, or a verify
    runner's accepted tokens): alive while their memory is held."""
    cache, runner = engine.cache, engine.runner
    planes = [t for layer in range(cache.config.num_layers) for t in cache.planes(layer).values()]
    output = runner.logits if hasattr(runner, "logits") else runner.result
    return [weakref.ref(t) for t in [*planes, output]]


@pytest.mark.parametrize("speculative", [None, SpeculativeConfig("ngram")])
@pytest.mark.parametrize("overlap", [False, True])
def test_dropping_the_last_reference_frees_the_store_without_a_gc_pass(speculative, overlap):
    if speculative is not None and overlap:
        pytest.skip("a speculating engine does not overlap")
    gc.disable()  # a reference cycle would keep everything alive until the collector ran
    try:
        engine = served(speculative=speculative, overlap=overlap)
        refs = storage_refs(engine)
        del engine
        assert all(ref() is None for ref in refs)
    finally:
        gc.enable()


def test_close_frees_the_store_while_the_engine_object_lives_and_then_refuses_every_use():
    engine = served()
    refs = storage_refs(engine)
    engine.close()
    assert engine.closed and all(ref() is None for ref in refs)
    with pytest.raises(StepError, match="closed"):
        engine.step()
    with pytest.raises(StepError, match="closed"):
        engine.submit(Request([1, 2], SamplingParams(max_new_tokens=2)))
    with pytest.raises(StepError, match="closed"):
        _ = engine.has_work
    engine.close()  # a second close does nothing


def test_a_with_block_closes_the_engine_when_it_ends_even_on_an_error():
    with served() as engine:
        refs = storage_refs(engine)
    assert engine.closed and all(ref() is None for ref in refs)
    with pytest.raises(RuntimeError, match="inside"), served() as other:
        refs = storage_refs(other)
        raise RuntimeError("inside the block")
    assert other.closed and all(ref() is None for ref in refs)
