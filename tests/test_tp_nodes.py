"""Tensor parallelism across hosts, as torchrun starts it: two torchrun "nodes" on this machine
(`--nnodes 2 --node-rank R`, a static rendezvous on 127.0.0.1, gloo) give the tokens of one
process, and killing node 1's rank ends rank 0's engine with a TensorParallelError naming the rank
and its node."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time

from batchkv.executor import Engine, Request, SamplingParams
from batchkv.models import build_model
from tests.serve_helpers import free_port
from tests.test_tp_faults import ROOT_ENV
from tests.tp_torchrun import PROMPTS


def torchrun_node(node: int, port: int, env: dict) -> subprocess.Popen:
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
               "--node-rank", str(node), "--rdzv-endpoint", f"127.0.0.1:{port}", "--max-restarts", "0",
               "tests/tp_torchrun_nodes.py"]  # fmt: skip
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "stderr": subprocess.DEVNULL}
    return subprocess.Popen(command, env=env, cwd=ROOT_ENV["PYTHONPATH"], text=True, start_new_session=True, **pipes)


def read_line(proc: subprocess.Popen, timeout: float) -> str:
    """The next line `proc` prints, or "" when none comes within `timeout` seconds."""
    if select.select([proc.stdout], [], [], timeout)[0]:
        return proc.stdout.readline().strip()
    return ""


def gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.1)
    return not os.path.exists(f"/proc/{pid}")


def test_two_torchrun_nodes_decode_as_one_process_and_a_killed_node_ends_the_other_with_the_typed_error(tmp_path):
    env = {**ROOT_ENV, "BATCHKV_TEST_DIR": str(tmp_path), "BATCHKV_TP_TIMEOUT": "30", "OMP_NUM_THREADS": "1"}
    port = free_port()
    nodes = [torchrun_node(node, port, env) for node in (0, 1)]
    try:
        engine = Engine(build_model("sensenova-u1-tiny", "cpu", seed=0), max_seqs=4, capacity=128)
        ids = [engine.submit(Request(p, SamplingParams(max_new_tokens=10))) for p in PROMPTS]
        events = engine.run_until_done()
        expected = json.dumps([[e.token for e in events if e.request_id == i and e.token is not None] for i in ids])
        lines = [read_line(nodes[0], 240), read_line(nodes[0], 60)]  # the tokens, then READY (mid-request)
        assert lines == [expected, "READY"]
        os.kill(int((tmp_path / "rank1.pid").read_text()), signal.SIGKILL)
        start = time.monotonic()
        nodes[0].stdin.write("go\n")
        nodes[0].stdin.flush()
        failed = json.loads(read_line(nodes[0], 60) or "{}")
        assert time.monotonic() - start < 30  # within BATCHKV_TP_TIMEOUT (30 s) and the report wait
        assert failed.get("error") == "TensorParallelError", failed
        assert "rank 1 on node 1 (" in failed["message"] and "stopped" in failed["message"], failed
        assert gone(int((tmp_path / "rank0.pid").read_text()), 30)  # rank 0's script ended
        # (node 0's torchrun agent would now wait out its exit barrier for node 1's: it is stopped below)
    finally:
        for proc in nodes:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
