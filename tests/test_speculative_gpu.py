"""Speculative decoding with CUDA graphs on the GPU: the same tokens as eager speculative decoding
and as plain decoding, captures bounded by the width buckets (no per-length recapture)."""

from __future__ import annotations

import random

import pytest
import torch

from batchkv.executor import Engine, Request, SamplingParams, SpeculativeConfig, gather
from batchkv.models import build_model
from batchkv.models.dflash import build_drafter

pytestmark = pytest.mark.gpu


def _requests(seed: int, vocab: int, count: int = 12) -> list[Request]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        motif = [rng.randrange(vocab) for _ in range(rng.randint(2, 5))]
        prompt = (motif * 12)[: rng.randint(3, 60)]
        out.append(Request(prompt, SamplingParams(max_new_tokens=rng.randint(8, 40), n=2 if i == 4 else 1)))
    return out


def _serve(engine: Engine, requests: list[Request]) -> list[list[list[int]]]:
    ids = [engine.submit(r) for r in requests]
    out = gather(engine.run_until_done())
    engine.assert_idle()
    return [out[i].tokens for i in ids]


@pytest.mark.parametrize("method", ["ngram", "dflash"])
def test_speculative_graphs_decode_the_eager_tokens_with_captures_bounded_by_buckets(method):
    model = build_model("sensenova-u1-tiny", "cuda", seed=0)
    drafter = build_drafter(model, num_layers=2, target_layer_ids=(0, 2), block_size=8, seed=1)
    spec = SpeculativeConfig(method, block_size=8, drafter=drafter if method == "dflash" else None)
    opts = {"max_seqs": 8, "capacity": 160, "max_step_tokens": 64, "prefill_chunk": 32}
    requests = _requests(1, model.vocab_size)
    plain = _serve(Engine(model, use_graphs=False, **opts), requests)
    eager = _serve(Engine(model, use_graphs=False, speculative=spec, **opts), requests)
    graphed = Engine(model, use_graphs=True, speculative=spec, **opts)
    assert _serve(graphed, requests) == eager == plain
    verify = graphed.runner.graphs
    assert verify.captures <= 2 * len(graphed.buckets) ** 2 and verify.replays > verify.captures
    if method == "dflash":
        draft = graphed.speculator.proposer.runner.graphs
        assert 0 < draft.captures < draft.replays
    torch.cuda.synchronize()
