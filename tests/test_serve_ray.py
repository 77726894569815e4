"""batchkv on Ray Serve (`batchkv.cli.ray`): a local Ray cluster of bounded CPUs, started once here,
serves two engine replicas of the tiny preset behind one OpenAI-compatible endpoint on 127.0.0.1.
The official `openai` client gets one engine's greedy tokens; 64 requests over four long shared
prefixes are routed so that each prefix is computed once (the replicas' prefix-cache counters); a
killed replica is replaced by Ray while the endpoint keeps answering; and shutting Serve and Ray
down leaves no process of theirs running."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

import ray  # noqa: E402
from ray import serve  # noqa: E402

from batchkv.cli.ray import APP, ENGINE, build, replica_stats  # noqa: E402
from batchkv.errors import ConfigError  # noqa: E402
from batchkv.executor import Engine, Request, SamplingParams  # noqa: E402
from batchkv.executor.prefix import block_hashes  # noqa: E402
from batchkv.models import build_model  # noqa: E402
from tests.serve_helpers import free_port  # noqa: E402

OPTIONS = {"model": "sensenova-u1-tiny", "served-model-name": "tiny", "device": "cpu", "ray-replicas": 2,
           "max-seqs": 16, "capacity": 256, "prefill-chunk": 16, "threads": 1}  # fmt: skip
PROMPTS = [[5, 17, 99, 3, 250], list(range(40, 70)), [7] * 20, list(range(300, 340))]


BEFORE_RAY: set[int] = set()  # this process's children before the cluster started (not Ray's)


def descendants(root: int) -> set[int]:
    """Pids of every live process below `root` (from /proc)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = set(), {root}
    for _ in range(64):  # depth bound
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - found
        if not frontier:
            break
        found |= frontier
    return found


@pytest.fixture(scope="module")
def endpoint():
    """The application on a local cluster; yields its URL. Torn down by the last test (or here)."""
    global BEFORE_RAY
    BEFORE_RAY = descendants(os.getpid())  # e.g. multiprocessing's resource tracker from earlier tests
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build(OPTIONS), name=APP, route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    if ray.is_initialized():
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def client(endpoint):
    return openai.OpenAI(base_url=endpoint + "/v1", api_key="unused", max_retries=0, timeout=120)


def greedy(prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """One engine's greedy tokens (the same options as each replica's)."""
    engine = Engine(build_model("sensenova-u1-tiny", "cpu", seed=0), max_seqs=16, capacity=256, prefill_chunk=16)
    ids = [engine.submit(Request(p, SamplingParams(max_new_tokens=max_new))) for p in prompts]
    events = engine.run_until_done()
    return [[e.token for e in events if e.request_id == i and e.token is not None] for i in ids]


def complete(client, prompt: list[int], max_tokens: int) -> list[int]:
    reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                      extra_body={"return_token_ids": True})  # fmt: skip
    return reply.choices[0].token_ids


def totals() -> dict[str, int]:
    stats = replica_stats().values()
    return {key: sum(s[key] for s in stats) for key in ("prefix_admitted", "prefix_hits", "prefix_reused")}


def test_tensor_parallel_replicas_off_the_gpu_are_refused_before_anything_is_deployed():
    with pytest.raises(ConfigError, match="add --device cuda"):
        build({"model": "sensenova-u1-tiny", "tensor-parallel-size": 2, "ray-replicas": 2})


def test_two_replicas_answer_the_openai_client_with_one_engines_greedy_tokens(client):
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda p: complete(client, p, 8), PROMPTS))
    assert got == greedy(PROMPTS, 8)
    assert len(replica_stats()) == 2


def test_requests_sharing_four_prefixes_compute_each_prefix_on_one_replica(client):
    prefixes = [[(97 * k + 13 * i) % 500 + 1 for i in range(64)] for k in range(4)]  # four blocks each
    prompts = [prefixes[j % 4] + [1 + j, 2 + j, 3 + j, 4 + j] for j in range(64)]  # round robin over them
    before = totals()
    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda p: complete(client, p, 2), prompts))
    stats = replica_stats().values()
    after = totals()
    assert all(len(r) == 2 for r in replies)
    assert after["prefix_admitted"] - before["prefix_admitted"] == 64
    # Each prefix computed once: every later request of it reuses it (a request that arrives while the
    # first still writes it waits for the shared blocks: prefill chunks of 16 tokens).
    assert after["prefix_hits"] - before["prefix_hits"] == 60
    holders = [sum(block_hashes(prefix)[0] in set(s["blocks"]) for s in stats) for prefix in prefixes]
    assert holders == [1, 1, 1, 1]  # each replica's own index: a prefix's blocks live on one replica
    assert all(s["prefix_admitted"] >= 16 for s in stats)  # two prefixes each: both replicas serve


def test_a_killed_replica_is_replaced_and_the_endpoint_keeps_answering(client):
    expected = greedy(PROMPTS[:1], 4)[0]
    old = set(replica_stats())
    victim = sorted(old)[0]
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    answered = 0
    for _ in range(60):  # the first may reach the dead replica (503); the router then drops it
        try:
            answered += complete(client, PROMPTS[0], 4) == expected
        except openai.APIStatusError as exc:
            assert exc.status_code == 503, exc
        if answered >= 3:
            break
        time.sleep(0.2)
    assert answered >= 3
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        now, status = set(replica_stats()), serve.status().applications[APP].deployments[ENGINE].status
        if len(now) == 2 and victim not in now and status == "HEALTHY":
            break
        time.sleep(0.5)
    assert len(now) == 2 and victim not in now and len(now & old) == 1 and status == "HEALTHY"
    assert [complete(client, PROMPTS[0], 4) for _ in range(4)] == [expected] * 4


def test_shutting_serve_and_ray_down_leaves_nothing_running(endpoint):
    started = descendants(os.getpid()) - BEFORE_RAY
    assert started  # Ray's processes: gcs, raylet, the replicas' workers
    serve.shutdown()
    ray.shutdown()
    deadline = time.monotonic() + 60
    while descendants(os.getpid()) & started and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not descendants(os.getpid()) & started
    with pytest.raises(httpx.TransportError):
        httpx.get(endpoint + "/health", timeout=2)
