"""Run under torchrun by tests/test_tp_cli.py: every rank runs this script; Engine(...) returns on
rank 0 only, which prints each request's tokens as one JSON line."""

import json

import torch

from batchkv.executor import Engine, Request, SamplingParams

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], list(range(10, 40))]

if __name__ == "__main__":
    torch.set_num_threads(1)
    with Engine("sensenova-u1-tiny", tensor_parallel=2, max_seqs=4, capacity=128) as engine:
        ids = [engine.submit(Request(p, SamplingParams(max_new_tokens=10))) for p in PROMPTS]
        events = engine.run_until_done()
        print(json.dumps([[e.token for e in events if e.request_id == i and e.token is not None] for i in ids]))
