"""Device sampling: the distribution it draws from (against transformers' own logits warpers) and
reproducibility per request, whatever the request is batched with."""

from __future__ import annotations

import random

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from batchkv.errors import RequestError
from batchkv.executor import Engine, Request, SamplingParams
from batchkv.executor.sampling import sample_tokens, uniform
from tests.executor_helpers import drive, greedy, oracle, random_prompt
from tests.toy_model import ToyModel


@pytest.fixture(scope="module")
def model():
    return ToyModel(seed=0)


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 5, 1.0), (0.8, 0, 0.9), (1.0, 12, 0.6), (2.0, 200, 0.95)],
)
def test_sampled_frequencies_match_transformers_warped_softmax(temperature, top_k, top_p):
    vocab, draws = 61, 8192
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(top_k + 7)) * 2.5
    scores = TemperatureLogitsWarper(temperature)(None, logits[None].clone())
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    expected = torch.softmax(scores[0], dim=-1)
    grid = (torch.arange(draws, dtype=torch.float32) + 0.5) / draws  # inverse CDF on a grid: exact counts
    tokens = sample_tokens(
        logits[None].expand(draws, vocab),
        torch.full((draws,), temperature),
        torch.full((draws,), top_k, dtype=torch.int64),
        torch.full((draws,), top_p),
        grid,
    )
    observed = torch.bincount(tokens, minlength=vocab).float() / draws
    assert (observed - expected).abs().max() <= 1.0 / draws + 1e-5
    assert set(tokens.tolist()) <= set(torch.nonzero(expected).flatten().tolist())  # never a filtered token


def test_greedy_rows_take_the_argmax_beside_sampled_rows():
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(1))
    temperature = torch.tensor([0.0, 1.0, 0.0, 1.0, 0.0, 1.0])
    no_top_k = torch.zeros(6, dtype=torch.int64)
    tokens = sample_tokens(logits, temperature, no_top_k, torch.ones(6), torch.full((6,), 0.99))
    greedy_rows = temperature == 0
    assert torch.equal(tokens[greedy_rows], logits.argmax(-1)[greedy_rows])


def test_uniform_draws_are_a_pure_function_of_seed_sample_and_index():
    values = [uniform(seed, s, i) for seed in (0, 1, 2**62) for s in range(3) for i in range(300)]
    assert values == [uniform(seed, s, i) for seed in (0, 1, 2**62) for s in range(3) for i in range(300)]
    assert all(0.0 <= v < 1.0 for v in values) and len(set(values)) > 0.99 * len(values)
    assert abs(sum(values) / len(values) - 0.5) < 0.02


def test_a_seeded_request_gives_the_same_tokens_with_different_neighbours(model):
    params = SamplingParams(max_new_tokens=20, temperature=0.9, top_k=20, top_p=0.95, seed=1234, n=2)
    target = Request([4, 8, 15, 16, 23, 42], params)
    alone, ids = drive(Engine(model, max_seqs=4, capacity=64, max_step_tokens=16, prefill_chunk=8), [(0, target)])
    rng = random.Random(9)
    crowd = [(rng.randint(0, 6), Request(random_prompt(rng, 1, 30), SamplingParams(max_new_tokens=15,
              temperature=rng.choice([0.0, 1.0]), seed=rng.randrange(100)))) for _ in range(7)]  # fmt: skip
    crowded, crowd_ids = drive(
        Engine(model, max_seqs=6, capacity=64, max_step_tokens=24, prefill_chunk=4, seed=5), [*crowd, (5, target)]
    )
    assert crowded[crowd_ids[-1]].tokens == alone[ids[0]].tokens
    first, second = alone[ids[0]].tokens
    assert first != second  # each sample draws its own stream
    greedy_tokens, _ = oracle(model, Request(target.prompt_ids, greedy(20)), 64)
    assert first != greedy_tokens  # it really sampled


def test_top_k_one_and_tiny_top_p_sample_the_greedy_tokens(model):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    schedule = [
        (0, Request(prompt, SamplingParams(max_new_tokens=12, temperature=1.5, top_k=1, seed=3))),
        (0, Request(prompt, SamplingParams(max_new_tokens=12, temperature=1.5, top_p=1e-6, seed=4))),
    ]
    outputs, ids = drive(Engine(model, max_seqs=4, capacity=64, max_step_tokens=16, prefill_chunk=8), schedule)
    expected, _ = oracle(model, Request(prompt, greedy(12)), 64)
    assert outputs[ids[0]].tokens == [expected] and outputs[ids[1]].tokens == [expected]


def test_unseeded_requests_follow_the_engine_seed(model):
    request = Request([7, 7, 7], SamplingParams(max_new_tokens=10, temperature=1.0))

    def run(seed):
        engine = Engine(model, max_seqs=2, capacity=32, max_step_tokens=8, prefill_chunk=8, seed=seed)
        outputs, ids = drive(engine, [(0, request)])
        return outputs[ids[0]].tokens

    assert run(1) == run(1)
    assert run(1) != run(2)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -0.1},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": -1},
        {"n": 0},
        {"n": 1025},
        {"max_new_tokens": 0},
    ],
)
def test_bad_sampling_parameters_are_refused(kwargs):
    with pytest.raises(RequestError):
        SamplingParams(**kwargs)
