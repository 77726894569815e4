"""Tensor parallelism on two GPUs (NCCL): CUDA graphs with the all-reduces captured, overlap,
sampling and speculation give one GPU's tokens; a rank killed mid-run ends the engine without a
hang. Needs two GPUs (nvidia-h200-x2)."""

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


@pytest.mark.parametrize("speculative", [None, SpeculativeConfig("ngram", block_size=4)], ids=["overlap", "ngram"])
def test_two_gpus_replaying_graphs_emit_one_gpus_tokens(speculative):
    plan = schedule(3, 512, sampled=True)
    options = {**ENGINE, "device": "cuda", "speculative": speculative}
    reference = Engine(build_model("sensenova-u1-tiny", "cuda", seed=0), **options)
    expected = outputs(reference, plan)
    reference.close()
    with Engine("sensenova-u1-tiny", tensor_parallel=2, **options) as engine:
        assert engine.uses_graphs and engine.overlap == (speculative is None)
        assert outputs(engine, plan) == expected
        assert engine.runner.captures > 0 and engine.runner.replays > engine.runner.captures


def test_a_rank_killed_on_the_gpu_ends_the_engine_within_seconds():
    with Engine("sensenova-u1-tiny", tensor_parallel=2, **ENGINE, device="cuda") as engine:
        engine.submit(Request(list(range(1, 20)), SamplingParams(max_new_tokens=60, ignore_eos=True)))
        for _ in range(4):
            engine.step()
        os.kill(engine.tp.group.procs[0].pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(TensorParallelError, match="rank 1"):
            for _ in range(100):
                engine.step()
        assert time.monotonic() - start < 60
