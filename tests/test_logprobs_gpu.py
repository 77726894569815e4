"""Log-probabilities on the H200: replayed graphs with overlap (logprobs copied to pinned slots and
read one step behind) give what an eager engine without overlap gives, and both equal torch's
log_softmax of the same model's full forward."""

from __future__ import annotations

import pytest
import torch

from batchkv.executor import Engine, Request, SamplingParams
from tests.executor_helpers import drive
from tests.toy_model import ToyModel

pytestmark = pytest.mark.gpu
PROMPTS = [[5, 17, 33, 9], list(range(3, 90)), [9, 200, 150]]


@pytest.fixture(scope="module")
def model():
    return ToyModel(vocab=512, hidden=256, heads=8, kv_heads=2, head_dim=64, dtype=torch.float32, device="cuda", seed=0)


def schedule() -> list[tuple[int, Request]]:
    out = [(i, Request(p, SamplingParams(max_new_tokens=8, logprobs=4))) for i, p in enumerate(PROMPTS)]
    out.append((1, Request(PROMPTS[1], SamplingParams(max_new_tokens=3, prompt_logprobs=2))))
    out.append((2, Request(PROMPTS[0], SamplingParams(max_new_tokens=6, temperature=0.8, seed=1, n=2, logprobs=1))))
    out.append((0, Request(PROMPTS[2], SamplingParams(max_new_tokens=10))))  # asks for nothing
    return out


def test_graphs_with_overlap_give_the_logprobs_eager_gives_without_it(model):
    opts = {"max_seqs": 8, "capacity": 256, "max_step_tokens": 64, "prefill_chunk": 32, "device": "cuda"}
    eager, ids = drive(Engine(model, use_graphs=False, overlap=False, **opts), schedule())
    piped, piped_ids = drive(Engine(model, use_graphs=True, overlap=True, **opts), schedule())
    for a, b in zip(ids, piped_ids, strict=True):
        x, y = eager[a], piped[b]
        assert x.tokens == y.tokens
        for xs, ys in zip(x.logprobs, y.logprobs, strict=True):
            assert [e.token for e in xs] == [e.token for e in ys]
            assert [e.logprob for e in xs] == pytest.approx([e.logprob for e in ys], abs=1e-4)
    scored = eager[ids[3]].prompt_logprobs
    assert scored is not None and len(scored) == len(PROMPTS[1]) and piped[piped_ids[3]].prompt_logprobs is not None
    assert [e.logprob for e in scored[1:]] == pytest.approx(
        [e.logprob for e in piped[piped_ids[3]].prompt_logprobs[1:]], abs=1e-4
    )
    for index in (0, 1):  # greedy answers against the eager full forward
        prompt, out = PROMPTS[index], piped[piped_ids[index]]
        history = prompt + out.tokens[0]
        with torch.no_grad():
            rows = torch.log_softmax(model.reference_logits(history).float(), dim=-1)[len(prompt) - 1 : -1]
        got = [e.logprob for e in out.logprobs[0]]
        assert got == pytest.approx([rows[i, t].item() for i, t in enumerate(out.tokens[0])], abs=1e-3)
