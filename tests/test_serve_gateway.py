"""The model-server protocol's gauges on /metrics (what the Gateway API Inference Extension's endpoint
picker routes by): vLLM's names beside batchkv's, with the engine's waiting and running requests and
the fraction of the store's positions that live requests hold. Read back with prometheus_client's
own text parser."""

from __future__ import annotations

import pytest

pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families

from batchkv.executor import Engine, Request, SamplingParams
from batchkv.models import build_model
from batchkv.serve.metrics import ServerMetrics
from batchkv.serve.worker import EngineWorker

CAPACITY = 96


def scrape(metrics: ServerMetrics) -> dict[str, tuple[dict[str, str], float]]:
    """Every sample of the exposition by name: (labels, value)."""
    text = metrics.exposition().decode()
    return {s.name: (s.labels, s.value) for family in text_string_to_metric_families(text) for s in family.samples}


def observed(engine: Engine) -> dict[str, tuple[dict[str, str], float]]:
    metrics = ServerMetrics(engine.cache.max_seqs)
    EngineWorker(engine, metrics, max_waiting=8)._observe()  # what the engine thread does after each step
    return scrape(metrics)


@pytest.fixture(scope="module")
def model():
    return build_model("sensenova-u1-tiny", "cpu", seed=0)


@pytest.mark.parametrize("kv_positions", [None, 2 * CAPACITY], ids=["grown on demand", "allocated whole"])
def test_the_gateway_gauges_say_what_the_engine_holds_waits_for_and_runs(model, kv_positions):
    engine = Engine(model, max_seqs=2, capacity=CAPACITY, kv_positions=kv_positions, prefill_chunk=16)
    prompts = [list(range(1, 40)), list(range(50, 70)), list(range(100, 130))]
    for prompt in prompts:
        engine.submit(Request(prompt, SamplingParams(max_new_tokens=20, ignore_eos=True)))
    engine.step()  # two admitted (two columns), the third waits
    m = observed(engine)
    assert engine.num_running == 2 and engine.num_waiting == 1
    assert m["vllm:num_requests_running"][1] == m["batchkv_requests_running"][1] == 2
    assert m["vllm:num_requests_waiting"][1] == m["batchkv_requests_waiting"][1] == 1
    held = sum(engine.cache.reach(seq) for seq in engine.cache.sequences)
    assert held >= (39 + 19) + (20 + 19)  # each column reaches its prompt and max_new_tokens less one
    total = 2 * CAPACITY  # two columns at full capacity, or the store allocated whole
    assert m["batchkv_kv_positions_in_use"][1] == held and m["batchkv_kv_positions_total"][1] == total
    assert m["vllm:kv_cache_usage_perc"][1] == pytest.approx(held / total)
    assert m["vllm:cache_config_info"] == ({"block_size": "16", "num_gpu_blocks": str(total // 16)}, 1.0)
    engine.run_until_done()
    idle = observed(engine)
    assert idle["batchkv_kv_columns_cached"][1] >= 1  # finished histories stay for reuse...
    assert idle["vllm:kv_cache_usage_perc"][1] == 0.0  # ...and count as free, as vLLM's cached blocks do
    assert idle["vllm:num_requests_running"][1] == idle["vllm:num_requests_waiting"][1] == 0
