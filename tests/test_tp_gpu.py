"""Tensor parallelism on two GPUs (NCCL): CUDA graphs with the all-reduces captured (also ahead,
by Engine.warm_up), overlap, sampling, e4m3 storage and speculation give one GPU's tokens; a rank
killed mid-run ends the engine without a hang. Needs two GPUs (nvidia-h200-x2)."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from batchkv.errors import TensorParallelError
from batchkv.executor import Engine, Request, SamplingParams, SpeculativeConfig
from batchkv.models import build_model
from tests.test_tp import ENGINE, outputs, schedule

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs"),
]


CASES = {  # options, and whether the engine warms up first (Engine.warm_up: every width captured)
    "overlap, warmed up": ({}, True),
    "e4m3": ({"kv_dtype": torch.float8_e4m3fn}, False),
    "ngram": ({"speculative": SpeculativeConfig("ngram", block_size=4)}, False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_two_gpus_replaying_graphs_emit_one_gpus_tokens(case):
    extra, warm = CASES[case]
    plan = schedule(3, 512, sampled=True)
    options = {**ENGINE, "device": "cuda", "kv_positions": 4 * 64, **extra}  # the store whole: captures last
    reference = Engine(build_model("sensenova-u1-tiny", "cuda", seed=0), **options)
    expected = outputs(reference, plan)
    reference.close()
    with Engine("sensenova-u1-tiny", tensor_parallel=2, **options) as engine:
        assert engine.uses_graphs and engine.overlap == ("speculative" not in extra)
        if warm:
            long = sum(min(engine.cache.config.max_write, width) > 16 for width in engine.buckets)  # and short
            assert engine.warm_up() > 0 and engine.runner.captures == len(engine.buckets) + long
        captured = engine.runner.captures
        assert outputs(engine, plan) == expected
        assert engine.runner.replays > engine.runner.captures > 0
        if warm:  # every rank replays what it captured in the warm-up
            assert engine.runner.captures == captured


def test_a_rank_killed_on_the_gpu_ends_the_engine_within_seconds():
    with Engine("sensenova-u1-tiny", tensor_parallel=2, **ENGINE, device="cuda") as engine:
        engine.submit(Request(list(range(1, 20)), SamplingParams(max_new_tokens=60, ignore_eos=True)))
        for _ in range(4):
            engine.step()
        os.kill(engine.role.group.procs[0].pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(TensorParallelError, match="rank 1"):
            for _ in range(100):
                engine.step()
        assert time.monotonic() - start < 60
