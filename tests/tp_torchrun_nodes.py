"""Run by tests/test_tp_nodes.py as two torchrun "nodes" of one rank each. Rank 0 prints the tokens
of tp_torchrun.PROMPTS as one JSON line, then decodes a long request, prints READY and waits for a
line on stdin (the test kills node 1's rank meanwhile), then steps until the engine fails and
prints the error as JSON. Every rank first writes its pid to $BATCHKV_TEST_DIR/rank<RANK>.pid."""

import json
import os
import sys
from pathlib import Path

import torch

from batchkv.errors import TensorParallelError
from batchkv.executor import Engine, Request, SamplingParams
from tests.tp_torchrun import PROMPTS

if __name__ == "__main__":
    torch.set_num_threads(1)
    Path(os.environ["BATCHKV_TEST_DIR"], f"rank{os.environ['RANK']}.pid").write_text(str(os.getpid()))
    with Engine("sensenova-u1-tiny", tensor_parallel=2, max_seqs=4, capacity=128) as engine:
        ids = [engine.submit(Request(p, SamplingParams(max_new_tokens=10))) for p in PROMPTS]
        events = engine.run_until_done()
        print(json.dumps([[e.token for e in events if e.request_id == i and e.token is not None] for i in ids]))
        engine.submit(Request(list(range(1, 20)), SamplingParams(max_new_tokens=100, ignore_eos=True)))
        engine.step()
        print("READY", flush=True)
        sys.stdin.readline()  # node 1's rank is killed meanwhile
        try:
            for _ in range(100):
                engine.step()
            print(json.dumps({"error": None}))
        except TensorParallelError as exc:
            print(json.dumps({"error": type(exc).__name__, "message": str(exc)}), flush=True)
