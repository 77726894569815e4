"""Log-probabilities on a real trained model (SmolLM2-135M-Instruct, CPU, float32): a chat answer's
logprobs and top 5 equal torch.log_softmax of transformers' logits, and prompt_logprobs over prose
give transformers' own loss."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from batchkv.executor import Engine, Request, SamplingParams, gather
from tests.real_model import CHATS, chat_ids, gguf_path, hf_model, threads, tokenizer

pytestmark = pytest.mark.slow
TOKENS = 130  # three 64-token chunks, the last one short
ENGINE = {"max_seqs": 64, "capacity": 256, "max_step_tokens": 128, "prefill_chunk": 64}


@pytest.fixture(scope="module")
def model():
    gguf_path()  # skips without the package
    from batchkv.models.hf import HFModel

    with threads():
        yield HFModel(hf_model())


def _one(model, request: Request):
    engine = Engine(model, **ENGINE)
    rid = engine.submit(request)
    with threads():
        out = gather(engine.run_until_done())[rid]
    engine.assert_idle()
    return out


@torch.no_grad()
def _log_softmax(ids: list[int]) -> torch.Tensor:
    with threads():
        return torch.log_softmax(hf_model()(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_a_chat_answers_logprobs_and_top_5_equal_log_softmax_of_transformers_logits(model):
    prompt = chat_ids(CHATS[3])
    out = _one(model, Request(prompt, SamplingParams(max_new_tokens=12, logprobs=5)))
    tokens, entries = out.tokens[0], out.logprobs[0]
    assert len(entries) == len(tokens) > 3
    expected = _log_softmax(prompt + tokens)
    for i, entry in enumerate(entries):
        row = expected[len(prompt) + i - 1]
        assert entry.token == tokens[i] == entry.top[0][0]  # greedy: the most likely
        assert entry.logprob == pytest.approx(row[entry.token].item(), abs=1e-4)
        assert [v for _, v in entry.top] == pytest.approx(row.topk(5).values.tolist(), abs=1e-4)


def test_prompt_logprobs_over_prose_give_transformers_own_loss(model):
    text = (Path(__file__).parent / "fixtures" / "prose.txt").read_text()
    ids = tokenizer()(text).input_ids[:TOKENS]
    out = _one(model, Request(ids, SamplingParams(max_new_tokens=1, prompt_logprobs=1)))
    scored = out.prompt_logprobs
    assert scored[0] is None and [e.token for e in scored[1:]] == ids[1:]
    with threads(), torch.no_grad():
        loss = float(hf_model()(torch.tensor([ids]), labels=torch.tensor([ids])).loss)
    nll = -sum(e.logprob for e in scored[1:]) / (TOKENS - 1)
    assert math.isclose(nll, loss, rel_tol=1e-4)
