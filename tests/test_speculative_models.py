"""Speculative decoding on real models: SenseNova-U1 tiny and a transformers Qwen3 through HFModel
(one variant with sliding-window layers), each against itself decoded without speculation."""

from __future__ import annotations

import random
from functools import partial

import pytest

from batchkv.executor import Request, SamplingParams, SpeculativeConfig
from batchkv.models import build_model
from tests.spec_helpers import ForcedProposer, plain_and_speculative

transformers = pytest.importorskip("transformers")


def schedule_for(vocab: int, seed: int, count: int = 7) -> list[tuple[int, Request]]:
    rng = random.Random(seed)
    schedule = []
    for i in range(count):
        motif = [rng.randrange(vocab) for _ in range(rng.randint(2, 4))]
        prompt = [*(motif * 10)[: rng.randint(3, 26)], i]
        params = SamplingParams(max_new_tokens=rng.randint(4, 18), n=2 if i == 1 else 1)
        schedule.append((rng.randint(0, 6), Request(prompt, params)))
    return schedule


def qwen3(sliding: bool):
    from tests.test_executor_models import _qwen3

    return _qwen3(use_sliding_window=True, sliding_window=6, max_window_layers=1) if sliding else _qwen3()


OPTS = {"max_seqs": 4, "capacity": 48, "max_step_tokens": 16, "prefill_chunk": 8}


@pytest.mark.parametrize("proposer", ["ngram", "forced"])
def test_sensenova_tiny_speculative_greedy_equals_plain(proposer):
    model = build_model("sensenova-u1-tiny", "cpu", seed=0)
    forced = partial(ForcedProposer, vocab=model.vocab_size) if proposer == "forced" else None
    schedule = schedule_for(model.vocab_size, 1)
    spec = SpeculativeConfig("ngram", block_size=5)
    plain, fast, engine = plain_and_speculative(model, schedule, spec, proposer=forced, **OPTS)
    assert fast == plain
    assert engine.metrics.spec_accepted > 0


@pytest.mark.parametrize("sliding", [False, True])
def test_transformers_qwen3_speculative_greedy_equals_plain(sliding):
    from batchkv.models.hf import HFModel

    model = HFModel(qwen3(sliding))
    schedule = schedule_for(model.vocab_size, 2)
    forced = partial(ForcedProposer, vocab=model.vocab_size, corrupt=lambda emitted, j: (emitted + j) % 5 == 3)
    spec = SpeculativeConfig("ngram", block_size=6)
    plain, fast, engine = plain_and_speculative(model, schedule, spec, proposer=forced, **OPTS)
    assert fast == plain
    m = engine.metrics
    assert m.spec_proposed > m.spec_accepted > 0
