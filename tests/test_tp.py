"""Tensor parallelism on the CPU (gloo): an engine sharded over 2 or 3 processes emits, token for
token, what the one-process engine emits, for SenseNova tiny (with its KV heads split, and with one
KV head replicated) and a tiny transformers Qwen3 (fp32), with arrivals, n > 1, a cancellation,
sampling, overlap, e4m3 storage and speculation; and one step's logits agree within fp32 rounding."""

from __future__ import annotations

import functools
import random
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from batchkv.executor import Engine, Request, SamplingParams, SpeculativeConfig
from batchkv.models import build_model
from batchkv.models.dflash import build_drafter
from batchkv.tp import Shard
from tests.executor_helpers import drive, random_prompt
from tests.tp_helpers import one_kv_head, save_qwen3

ENGINE = {"max_seqs": 4, "capacity": 64, "max_step_tokens": 32, "prefill_chunk": 16}


def schedule(seed: int, vocab: int, *, sampled: bool = False) -> tuple[list[tuple[int, Request]], dict]:
    """Requests arriving over the first steps, every fourth with n = 2, request 2 cancelled at step 5."""
    rng = random.Random(seed)
    out = []
    for i in range(7):
        extra = {"temperature": 0.9, "top_k": 40, "top_p": 0.9, "seed": i} if sampled and i % 2 else {}
        params = SamplingParams(max_new_tokens=rng.randint(2, 14), n=2 if i % 4 == 1 else 1, **extra)
        out.append((rng.randint(0, 6), Request(random_prompt(rng, 1, 30, vocab=vocab), params)))
    out[2] = (0, Request(random_prompt(rng, 20, 20, vocab=vocab), SamplingParams(max_new_tokens=30)))
    return out, {5: [2]}


def outputs(engine: Engine, plan: tuple[list, dict]) -> list[tuple]:
    got, ids = drive(engine, *plan)
    engine.assert_idle()
    return [(got[i].tokens, got[i].finish_reasons) for i in ids]


def first_logits(engine: Engine, prompt: list[int]) -> torch.Tensor:
    """The logits the step that writes `prompt` samples its first token from."""
    engine.submit(Request(prompt, SamplingParams(max_new_tokens=1)))
    engine.step()
    logits = engine.runner.logits[0].clone()
    engine.run_until_done()
    return logits


def tp_engine(source, world: int, **options) -> Engine:
    engine = Engine(source, tensor_parallel=world, **ENGINE, **options)
    assert engine.tp.world == world and dist.get_world_size() == world
    return engine


DRAFTER = functools.partial(build_drafter, num_layers=1, target_layer_ids=(0, 2), block_size=4, seed=1)
CASES = {  # plain greedy steps: the replicated-KV-head test below
    "sampled, overlap, e4m3": ({"overlap": True, "kv_dtype": torch.float8_e4m3fn}, True),
    "ngram speculation": ({"speculative": SpeculativeConfig("ngram", block_size=4)}, False),
    "dflash speculation": ({"speculative": SpeculativeConfig("dflash", block_size=4, drafter=DRAFTER)}, True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_serve_sensenova_tiny_as_one_process_does(case):
    options, sampled = CASES[case]
    plan = schedule(3, 512, sampled=sampled)
    expected = outputs(Engine(build_model("sensenova-u1-tiny", "cpu", seed=0), **ENGINE, **options), plan)
    with tp_engine("sensenova-u1-tiny", 2, **options) as engine:
        assert engine.cache.config.kv_heads == 1  # this rank's share of the 2 KV heads
        assert outputs(engine, plan) == expected
        assert any(finish == ["cancelled"] for _, finish in expected)
    assert not dist.is_initialized()  # closing stopped the group


def test_two_ranks_replicate_a_single_kv_head_and_agree_with_one_process_to_fp32_rounding():
    requests, cancels = schedule(4, 512)
    rng, system = random.Random(11), random_prompt(random.Random(10), 20, 20, vocab=512)
    for arrival in (8, 14, 20):  # a shared prefix: the prefix cache's clone, rewind and reserve run on every rank
        requests.append(
            (arrival, Request(system + random_prompt(rng, 1, 6, vocab=512), SamplingParams(max_new_tokens=4)))
        )
    plan = (requests, cancels)
    model = one_kv_head(Shard())
    reference = Engine(model, **ENGINE)
    expected = outputs(reference, plan)
    prompt = random_prompt(random.Random(9), 12, 12, vocab=512)
    want = first_logits(reference, prompt)
    with tp_engine(one_kv_head, 2) as engine:
        assert engine.cache.config.kv_heads == 1 and model.config.kv_heads == 1  # one head, held by both ranks
        environ = Path(f"/proc/{engine.tp.group.procs[0].pid}/environ").read_bytes().split(b"\0")
        assert {b"NCCL_NVLS_ENABLE=0", b"TORCH_SYMM_MEM_DISABLE_MULTICAST=1", b"NVSHMEM_DISABLE_NVLS=1"} <= set(environ)
        assert outputs(engine, plan) == expected
        assert engine.metrics.prefix_hits >= 2 and engine.metrics.prefix_hits == reference.metrics.prefix_hits
        got = first_logits(engine, prompt)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert got.shape == (512,)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("qwen3")
    return path, save_qwen3(path)


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_serve_a_transformers_qwen3_read_by_slices_as_one_process_does(qwen3_dir, world):
    from batchkv.models.hf import HFModel

    path, hf = qwen3_dir
    plan = schedule(5, 250)
    reference = Engine(HFModel(hf), **ENGINE)
    expected = outputs(reference, plan)
    prompt = random_prompt(random.Random(7), 9, 9, vocab=250)
    want = first_logits(reference, prompt)
    with tp_engine(path, world) as engine:
        assert engine.cache.config.kv_heads == 6 // world
        assert outputs(engine, plan) == expected
        got = first_logits(engine, prompt)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # 250 is not a multiple of 3: padded, then cut
    assert got.shape == (250,)
