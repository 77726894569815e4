"""The engine serving real models against oracles written elsewhere: the SenseNova-U1 tiny model
against its eager reference (batchkv.models.reference), and a tiny transformers Qwen3 against
transformers' own `generate`. Each request's greedy tokens must equal that request decoded alone."""

from __future__ import annotations

import math
import random

import pytest
import torch

from batchkv.executor import Engine, Request, SamplingParams
from batchkv.models import build_model
from batchkv.models.reference import reference_generate
from tests.executor_helpers import drive, random_prompt
from tests.test_executor_graphs import RecordingGraphs

transformers = pytest.importorskip("transformers")


def mixed_schedule(seed: int, vocab: int, count: int = 10) -> tuple[list[tuple[int, Request]], dict[int, list[int]]]:
    rng = random.Random(seed)
    schedule = []
    for i in range(count):
        params = SamplingParams(max_new_tokens=rng.randint(1, 20), n=2 if i % 4 == 1 else 1)
        schedule.append((rng.randint(0, 12), Request(random_prompt(rng, 1, 45, vocab=vocab), params)))
    schedule[3] = (0, Request(random_prompt(rng, 30, 30, vocab=vocab), SamplingParams(max_new_tokens=17)))
    return schedule, {6: [3]}  # request 3 is decoding at step 6


def test_sensenova_tiny_serves_every_request_as_its_reference_decodes_it_alone():
    model = build_model("sensenova-u1-tiny", "cpu", seed=0)
    schedule, cancels = mixed_schedule(1, model.vocab_size)
    capacity = 48  # some requests run into it
    engine = Engine(model, max_seqs=4, capacity=capacity, max_step_tokens=32, prefill_chunk=16)
    engine.runner.graphs, engine.runner.pad_rows = RecordingGraphs(), True  # graph-mode stepping
    outputs, ids = drive(engine, schedule, cancels)
    for index, (_, request) in enumerate(schedule):
        out = outputs[ids[index]]
        expected = reference_generate(model, request.prompt_ids, request.params.max_new_tokens)
        expected = expected[: capacity - len(request.prompt_ids) + 1]  # a full sequence emits one last token
        if index in cancels[6]:
            assert out.finish_reasons == ["cancelled"] and 0 < len(out.tokens[0]) < len(expected)
            assert out.tokens[0] == expected[: len(out.tokens[0])]
            continue
        assert out.tokens == [expected] * request.params.n, f"request {index}"
    engine.assert_idle()


def _qwen3(**extra) -> torch.nn.Module:
    cfg = transformers.Qwen3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, attn_implementation="sdpa", **extra,
    )  # fmt: skip
    model = transformers.Qwen3ForCausalLM(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # clear greedy winners: the default init gives near-ties
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                std = (8.0 if "lm_head" in name else 1.0) / math.sqrt(p.shape[1])
                p.copy_(torch.randn(p.shape, generator=gen) * (1.0 if "embed" in name else std))
    return model.eval()


@pytest.mark.parametrize("sliding", [False, True])
def test_a_transformers_qwen3_serves_every_request_as_its_own_generate_decodes_it(sliding):
    from batchkv.models.hf import HFModel

    hf = _qwen3(use_sliding_window=True, sliding_window=6, max_window_layers=1) if sliding else _qwen3()
    schedule, _ = mixed_schedule(2, 256, count=8)
    engine = Engine(HFModel(hf), max_seqs=4, capacity=96, max_step_tokens=16, prefill_chunk=8)
    outputs, ids = drive(engine, schedule)
    for index, (_, request) in enumerate(schedule):
        prompt = torch.tensor([request.prompt_ids])
        new = request.params.max_new_tokens
        with torch.no_grad():
            full = hf.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        expected = full[0, prompt.shape[1] :].tolist()
        assert outputs[ids[index]].tokens == [expected] * request.params.n, f"request {index}"
