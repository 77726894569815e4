"""The serving benchmark's parts: the lean client, the hop trace (on `batchkv serve` and on the
engine stand-in), the stand-in engine, and the per-request TTFT comparison."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

import pytest

from batchkv.executor import Request, SamplingParams
from bench import serve_client, serve_trace
from bench.online import run_online
from bench.serve_http import ttft_cost
from bench.serve_standin import StandinEngine
from tests.executor_helpers import working
from tests.serve_helpers import Server, free_port


def _bodies(prompts: list[list[int]], outputs: list[int]) -> list[bytes]:
    return [json.dumps({"prompt": p, "max_tokens": o, "temperature": 0, "stream": True, "ignore_eos": True}).encode()
            for p, o in zip(prompts, outputs, strict=True)]  # fmt: skip


def _traced_run(port: int, prompts: list[list[int]], outputs: list[int]) -> tuple[list[dict], dict]:
    records = serve_client.run(port, "/v1/completions", _bodies(prompts, outputs), [0.0, 0.01, 0.02], timeout=60)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/debug/trace", timeout=10) as answer:
        return records, json.loads(answer.read())


def _assert_every_hop_in_order(records: list[dict], trace: dict, outputs: list[int]) -> None:
    assert [len(r["times"]) for r in records] == outputs and not any(r["incomplete"] for r in records)
    for r in records:
        instants = {**trace[r["id"]], "sent": r["sent"], "read": r["times"][0]}
        assert [instants[h] for h in serve_trace.HOPS] == sorted(instants[h] for h in serve_trace.HOPS)
    hops = serve_trace.hops([{"id": r["id"], "sent": r["sent"], "read": r["times"][0]} for r in records], trace)
    assert hops["requests"] == len(records) and hops["http_path"]["p50"] > 0


def test_the_trace_times_every_hop_of_the_real_servers_streamed_requests_in_order():
    server = Server("sensenova-u1-tiny", "--max-seqs", "2", "--capacity", "64", launcher=("bench/serve_trace.py",))
    try:
        server.wait()
        outputs = [3, 5, 2]
        records, trace = _traced_run(server.port, [[1, 2, 3], [4, 5], [6]], outputs)
        _assert_every_hop_in_order(records, trace, outputs)
    finally:
        assert server.stop()[0] == 0


def test_the_standin_server_streams_each_request_its_tokens_with_every_hop_traced():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "bench/serve_standin.py", "--port", str(port), "--host-ms", "0.5",
                             "--device-ms", "0.5", "--chunk", "4"], stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "the stand-in server did not start"
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        outputs = [4, 1, 6]
        records, trace = _traced_run(port, [list(range(9)), [1], [2, 3]], outputs)
        _assert_every_hop_in_order(records, trace, outputs)
    finally:
        proc.terminate()
        proc.wait(30)


def test_the_standin_engine_prefills_in_chunks_then_emits_one_token_per_step():
    engine = StandinEngine(host_ms=0.0, device_ms=0.0, chunk=4)
    a = engine.submit(Request(list(range(9)), SamplingParams(max_new_tokens=2)))  # 3 prefill steps
    b = engine.submit(Request([1], SamplingParams(max_new_tokens=3)))
    steps = []
    for _ in working(engine, limit=20):
        steps.append([(e.request_id, e.finish_reason) for e in engine.step()])
    # overlapped: a step's tokens come out of the next call
    assert steps == [[], [(b, None)], [(b, None)], [(a, None), (b, "length")], [(a, "length")]]


def test_run_online_on_the_standin_gives_each_request_its_tokens_and_a_time_to_first_token():
    engine = StandinEngine(host_ms=0.0, device_ms=0.0, chunk=8)
    result = run_online(engine, [[1] * 20, [2] * 3, [3] * 9], [3, 1, 2], [0.0, 0.0, 0.001], per_request=True)
    assert result["tokens"] == 6 and len(result["ttft_ms_by_request"]) == 3
    assert all(t is not None and t >= 0 for t in result["ttft_ms_by_request"])


def test_ttft_cost_pairs_requests_by_index_and_skips_those_without_a_first_token():
    cost = ttft_cost([10.0, 20.0, None, 40.0, 50.0], [11.0, 23.0, 5.0, None, 52.0])
    assert cost["pairs"] == 3 and cost["p50"] == pytest.approx(2.0) and cost["mean"] == pytest.approx(2.0)
    assert cost["p50_ci90"][0] <= cost["p50"] <= cost["p50_ci90"][1]
    assert cost["mean_ci90"][0] <= cost["mean"] <= cost["mean_ci90"][1]
    assert ttft_cost([None], [1.0]) == {"pairs": 0}
