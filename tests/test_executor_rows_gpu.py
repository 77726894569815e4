"""512 and 1,024 rows a step on the GPU: the captured graphs of those widths (the trunk in the graph,
the LM head in chunks after it) sample and score exactly what eager steps do, with overlap on, for
greedy, top-k, top-p, min_p, penalties and logprobs mixed."""

from __future__ import annotations

import pytest
import torch

from batchkv.executor import Engine
from tests.test_executor_rows import _flatten, mixed, run
from tests.toy_model import ToyModel

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model():
    return ToyModel(vocab=512, hidden=256, heads=8, kv_heads=2, head_dim=64, window=32,
                    dtype=torch.bfloat16, device="cuda", seed=0)  # fmt: skip


@pytest.mark.parametrize("rows", [512, 1024])
def test_graphs_at_512_and_1024_rows_sample_and_score_what_eager_steps_do(model, rows):
    requests = mixed(rows // 4, seed=rows, max_new=6, scores=True, longest=1, n=4)
    opts = {"max_seqs": rows, "capacity": 16, "max_step_tokens": rows, "prefill_chunk": 8, "device": "cuda"}
    eager, graphed = Engine(model, use_graphs=False, **opts), Engine(model, use_graphs=True, **opts)
    assert graphed.uses_graphs and graphed.runner.chunked and graphed.overlap
    seen: list[int] = []
    expected, got = run(eager, requests, poison=True), run(graphed, requests, seen, poison=True)
    assert max(seen) == rows and graphed.runner.replays > 0
    for i, (a, b) in enumerate(zip(expected, got, strict=True)):
        assert (a.tokens, a.finish_reasons) == (b.tokens, b.finish_reasons), f"request {i}"
        assert _flatten(a.logprobs) == _flatten(b.logprobs), f"request {i}"
