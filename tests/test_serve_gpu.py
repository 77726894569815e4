"""`batchkv serve` on CUDA with graphs: the tiny preset over HTTP gives the in-process engine's tokens."""

from __future__ import annotations

import signal

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from batchkv.executor import Engine, Request, SamplingParams, gather  # noqa: E402
from batchkv.models import build_model  # noqa: E402
from tests.serve_helpers import Server  # noqa: E402


@pytest.mark.gpu
@pytest.mark.parametrize("max_seqs", ["8", "auto"])  # auto: a store sized to the GPU, the same schedule
def test_the_tiny_preset_served_with_graphs_gives_the_engines_greedy_tokens(max_seqs):
    free, total = torch.cuda.mem_get_info()
    if max_seqs == "auto" and total - free > 0.4 * total:  # the budget counts every process's memory
        pytest.skip("other processes hold over 40% of the GPU (run without pytest-xdist); auto sizing would refuse")
    args = ("--max-seqs", max_seqs, "--capacity", "256", "--max-step-tokens", "64", "--prefill-chunk", "32")
    server = Server("sensenova-u1-tiny", *args, "--memory-fraction", "0.5", device="cuda")
    prompts = [[(7 * i + j) % 512 for j in range(5 + 9 * i)] for i in range(6)]
    engine = Engine(build_model("sensenova-u1-tiny", "cuda", seed=0), max_seqs=8, capacity=256,
                    max_step_tokens=64, prefill_chunk=32)  # fmt: skip
    assert engine.uses_graphs
    ids = [engine.submit(Request(p, SamplingParams(max_new_tokens=20))) for p in prompts]
    outputs = gather(engine.run_until_done())
    del engine
    torch.cuda.empty_cache()
    try:
        url = server.wait().url + "/v1/completions"
        body = {"prompt": prompts, "max_tokens": 20, "temperature": 0}
        choices = httpx.post(url, json=body, timeout=120).json()["choices"]
        assert [c["token_ids"] for c in choices] == [outputs[i].tokens[0] for i in ids]
        assert "batchkv_graph_captures_total" in httpx.get(server.url + "/metrics").text
    finally:
        code, out = server.stop(signal.SIGTERM)
    assert code == 0, out
    assert ("sized the store: 64 sequences x 256 positions" in out) == (max_seqs == "auto"), out
