"""bench/lib/serve_client.py, the lean streaming client bench/real_model.py serves through: against a
real `batchkv serve`, each request's tokens read as they stream, each in order."""

from __future__ import annotations

import json

from bench.lib import serve_client
from tests.serve_helpers import Server


def test_the_lean_client_reads_every_streamed_token_of_each_request_from_the_real_server():
    server = Server("sensenova-u1-tiny", "--max-seqs", "2", "--capacity", "64")
    try:
        server.wait()
        prompts, outputs = [[1, 2, 3], [4, 5], [6]], [3, 5, 2]
        bodies = [json.dumps({"prompt": p, "max_tokens": o, "temperature": 0, "stream": True, "ignore_eos": True})
                  .encode() for p, o in zip(prompts, outputs, strict=True)]  # fmt: skip
        records = serve_client.run(server.port, "/v1/completions", bodies, [0.0, 0.01, 0.02], timeout=60)
    finally:
        assert server.stop()[0] == 0
    assert [r["index"] for r in records] == [0, 1, 2] and not any(r["incomplete"] for r in records)
    assert [len(r["times"]) for r in records] == outputs  # one instant per token read
    for r in records:
        assert r["sent"] <= r["times"][0] and r["times"] == sorted(r["times"]) and r["id"]
