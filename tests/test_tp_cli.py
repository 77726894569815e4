"""`batchkv run --tensor-parallel 2` and `batchkv serve --tensor-parallel-size 2` on the CPU: the
same tokens as one process, and Ctrl-C (SIGINT to the whole process group, as a terminal sends
it) stops every rank."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from batchkv import cli
from tests.test_cli_errors import default_sigint
from tests.test_tp_faults import ROOT_ENV, children_of

RUN = ["run", "--requests", "6", "--n", "2", "--prompt-len", "4:40", "--output-len", "4:16", "--max-seqs", "4",
       "--capacity", "128", "--device", "cpu"]  # fmt: skip


def test_run_on_two_ranks_writes_the_tokens_one_process_writes(tmp_path):
    outs = []
    for world in (1, 2):
        out = tmp_path / f"tp{world}.txt"
        args = [*RUN, "--tensor-parallel", str(world), "--output", str(out), "--json", str(tmp_path / "m.json")]
        assert cli.main(args) == 0
        outs.append(out.read_text())
    assert outs[0] == outs[1] and len(outs[0].splitlines()) == 12  # 6 requests, 2 samples each
    assert '"tensor_parallel": 2' in (tmp_path / "m.json").read_text()


def test_ctrl_c_stops_run_and_every_rank_with_the_summary_of_what_finished():
    command = [sys.executable, "-m", "batchkv.cli", "run", "--requests", "2000", "--output-len", "48:48",
               "--tensor-parallel", "2", "--progress", "on"]  # fmt: skip
    proc = subprocess.Popen(command, env=ROOT_ENV, stderr=subprocess.PIPE, stdout=subprocess.PIPE,
                            start_new_session=True, preexec_fn=default_sigint)  # fmt: skip
    seen, deadline = b"", time.monotonic() + 120
    while b" done " not in seen and time.monotonic() < deadline and proc.poll() is None:  # the bar: it steps
        if select.select([proc.stderr], [], [], 1.0)[0]:
            seen += os.read(proc.stderr.fileno(), 4096)
    ranks = children_of(proc.pid)
    assert b" done " in seen and len(ranks) == 1, seen.decode()[-2000:]
    os.killpg(proc.pid, signal.SIGINT)  # the whole group, as a terminal's Ctrl-C
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err.decode()[-2000:]
    assert b"interrupted" in err and b"tensor parallel 2" in out
    assert not any(Path(f"/proc/{pid}").exists() for pid in ranks)


def test_serve_on_two_ranks_answers_as_one_process_decodes_and_sigint_stops_every_rank():
    pytest.importorskip("fastapi")
    import httpx

    from batchkv.executor import Engine, Request, SamplingParams
    from batchkv.models import build_model
    from tests.serve_helpers import Server

    server = Server("sensenova-u1-tiny", "--tensor-parallel-size", "2", "--max-seqs", "4", "--capacity", "256",
                    "--served-model-name", "tiny", env={"PYTHONPATH": ROOT_ENV["PYTHONPATH"]})  # fmt: skip
    prompts = [[5, 17, 99, 3, 250], list(range(40, 70))]
    engine = Engine(build_model("sensenova-u1-tiny", "cpu", seed=0), max_seqs=4, capacity=256)
    ids = [engine.submit(Request(p, SamplingParams(max_new_tokens=12))) for p in prompts]
    events = engine.run_until_done()
    expected = [[e.token for e in events if e.request_id == i and e.token is not None] for i in ids]
    server.wait(timeout=180)
    ranks = children_of(server.proc.pid)
    assert len(ranks) == 1
    for prompt, want in zip(prompts, expected, strict=True):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, "return_token_ids": True}
        reply = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
        assert reply["choices"][0]["token_ids"] == want, reply
    code, output = server.stop(signal.SIGINT)
    assert code == 0 and "tensor parallel 2" in output, output[-3000:]
    assert not any(Path(f"/proc/{pid}").exists() for pid in ranks)


def test_under_torchrun_every_rank_runs_the_script_and_rank_0_alone_gets_the_engine():
    import json

    from batchkv.executor import Engine, Request, SamplingParams
    from batchkv.models import build_model
    from tests.tp_torchrun import PROMPTS

    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "tests/tp_torchrun.py"]  # fmt: skip
    proc = subprocess.run(command, env=ROOT_ENV, cwd=ROOT_ENV["PYTHONPATH"], capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("[[")]
    engine = Engine(build_model("sensenova-u1-tiny", "cpu", seed=0), max_seqs=4, capacity=128)
    ids = [engine.submit(Request(p, SamplingParams(max_new_tokens=10))) for p in PROMPTS]
    events = engine.run_until_done()
    assert lines == [json.dumps([[e.token for e in events if e.request_id == i and e.token is not None] for i in ids])]
