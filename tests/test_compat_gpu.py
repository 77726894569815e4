"""batchkv.compat on CUDA with graphs: the pipeline's decode loop replays one capture per
(bucket, generation) and still gives the eager DynamicCache loop's logits.

Needs batchkv's Triton sdpa_varlen (the torch reference cannot be captured); skipped otherwise.
Run on the GPU machine: `PYTHONPATH=$PWD python -m pytest tests/test_compat_gpu.py -q -ra`.
"""

from __future__ import annotations

import pytest
import torch

import batchkv.executor.graphs as graph_module
from batchkv import compat
from tests.pipeline_lm import PipelineLM, eager_loop, paged_loop, sensenova_runs
from tests.test_compat import SMALL, FakeLoRA, request

pytestmark = pytest.mark.gpu
DEVICE = "cuda"


@pytest.fixture(autouse=True)
def _kernel():
    if not compat.paged_decode_supported(DEVICE, 16):
        pytest.skip("needs batchkv's Triton sdpa_varlen (attention backend 'triton' is not built in this tree)")


def assert_close_for(dtype, got, want):
    """fp32: tight. bf16: within 5% of the largest logit (different kernels round differently)."""
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
    else:
        assert (got.float() - want.float()).abs().max() <= 0.05 * want.float().abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_graph_replays_give_the_eager_logits_and_capture_once_per_bucket_and_generation(dtype):
    lm = PipelineLM().to(DEVICE, dtype).eval()
    prompt, tokens = request(0, 5, 20)
    prompt = prompt.to(DEVICE)
    want, want_cache = eager_loop(lm, prompt, tokens)
    got, cache, (paged, runner) = paged_loop(lm, prompt, tokens, dtype=dtype, **SMALL)
    assert paged.bucket == 32 and runner.eager_steps == 0
    assert runner.captures == 4  # (8, g1), (16, g2), (24, g3), (32, g4)
    for a, b in zip(want, got, strict=True):
        assert_close_for(dtype, b, a)
    for a, b in zip(want_cache.layers, cache.layers, strict=True):
        assert_close_for(dtype, b.keys, a.keys)
        assert_close_for(dtype, b.values, a.values)


def test_a_second_request_replays_the_first_requests_capture():
    lm = PipelineLM().to(DEVICE).eval()
    prompt, tokens = request(1, 5, 20)
    _, _, context = paged_loop(lm, prompt.to(DEVICE), tokens, **SMALL)
    captures, generation = context[1].captures, context[0].generation
    prompt2, tokens2 = request(2, 9, 8)
    prompt2 = prompt2.to(DEVICE)
    got, _, (paged, runner) = paged_loop(lm, prompt2, tokens2, context=context)
    assert paged is context[0] and runner.captures == captures and paged.generation == generation
    want, _ = eager_loop(lm, prompt2, tokens2)
    for a, b in zip(want, got, strict=True):
        assert_close_for(torch.float32, b, a)


def test_an_adapter_wrapper_turns_graphs_off_and_drops_the_captures(monkeypatch):
    monkeypatch.setattr(graph_module, "_registered", [])
    compat.register_adapter_wrapper(FakeLoRA)
    lm = PipelineLM().to(DEVICE).eval()
    prompt, tokens = request(3, 5, 6)
    prompt = prompt.to(DEVICE)
    want, _ = eager_loop(lm, prompt, tokens)
    got, _, (paged, runner) = paged_loop(lm, prompt, tokens[:3], min_length=16, **SMALL)
    assert runner.captures == 1
    lm.layers[2].up = FakeLoRA(lm.layers[2].up)
    for i, token in enumerate(tokens[3:], start=3):
        paged.set_length(paged.length + 1)
        got.append(runner.step(token, len(prompt) + i)[0, -1].clone())
    assert runner.captures == 1 and runner.eager_steps == 3 and len(runner._graphs) == 0
    for a, b in zip(want, got, strict=True):
        assert_close_for(torch.float32, b, a)


def test_runners_share_one_graph_pool_per_device():
    lm = PipelineLM().to(DEVICE).eval()
    prompt, tokens = request(5, 4, 2)
    _, _, (_, first) = paged_loop(lm, prompt.to(DEVICE), tokens, **SMALL)
    _, _, (_, second) = paged_loop(lm, prompt.to(DEVICE), tokens, **SMALL)
    assert first is not second and first._graphs.pool == second._graphs.pool


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_batchkv_sensenova_replays_through_the_pipeline_signature(dtype):
    pytest.importorskip("batchkv.models.sensenova", reason="batchkv.models.sensenova is not in this tree")
    from batchkv.models import build_model

    model = build_model("sensenova-u1-tiny", DEVICE, dtype=dtype, seed=0)
    prompt, tokens = request(6, 60, 40, vocab=model.config.vocab)  # crosses the 64-row bucket
    (want, past), (got, dyn), runner = sensenova_runs(model, prompt.to(DEVICE), tokens, buckets=(64, 128))
    assert runner.captures == 2 and runner.eager_steps == 0
    for a, b in zip(want, got, strict=True):
        assert_close_for(dtype, b, a)
    for (k, v), layer in zip(past, dyn.layers, strict=True):
        assert_close_for(dtype, layer.keys, k[None])
        assert_close_for(dtype, layer.values, v[None])
