"""bench/lib/roofline.py: the per-step arithmetic of the fair serving roofline, against independent oracles.

Segments are checked against the cache's own seq_info, pair counts against a torch causal mask,
and a step's FLOPs against torch's FlopCounterMode over the real forward of that step.
"""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from batchkv import BatchedSequenceCache, CacheConfig
from batchkv.executor import Engine, Request, SamplingParams
from batchkv.models import build_model
from bench.lib.roofline import (
    ModelCost,
    Step,
    StepLog,
    causal_pairs,
    fair_seconds,
    model_cost,
    segments,
    step_bytes,
    step_flops,
)


@pytest.mark.parametrize("pattern", [[0, 0, 0, 1], [1, 0, 1, 1, 2], [2], [0, 1, 0, 2, 2, 0]])
def test_segments_match_the_seq_info_the_cache_stages(pattern):
    cfg = CacheConfig(num_layers=1, kv_heads=1, head_dim=16, max_seqs=3, capacity=64, max_write=8, dtype=torch.float32)
    cache = BatchedSequenceCache(cfg, device="cpu")
    seqs = [cache.seq_new() for _ in range(3)]
    for seq, length in zip(seqs, (5, 0, 2), strict=True):  # give each sequence a history
        if length:
            cache.declare_step([seq] * length)
            cache.prepare_step(width=length)
            cache.commit_step()
    ids = [seqs[i] for i in pattern]
    cache.declare_step(ids)
    cache.prepare_step(width=len(ids))
    staged = [(q_len, kv_end) for _, q_len, _, kv_end in cache.seq_info.tolist() if q_len]
    assert segments(ids, cache.pos) == staged


@pytest.mark.parametrize(("q_len", "kv_end"), [(1, 1), (1, 97), (4, 54), (17, 17), (5, 300)])
def test_causal_pairs_count_the_ones_of_a_causal_mask(q_len, kv_end):
    mask = torch.ones(q_len, kv_end, dtype=torch.bool).tril(kv_end - q_len)
    assert causal_pairs(q_len, kv_end) == int(mask.sum())


def test_step_flops_match_torch_flop_counter_over_the_real_forward():
    torch.manual_seed(0)
    model = build_model("sensenova-u1-tiny", "cpu", seed=0)
    engine = Engine(model, max_seqs=4, capacity=64, max_step_tokens=16, prefill_chunk=16)
    log = StepLog(engine)
    for prompt in ([1, 2, 3, 4, 5], [7, 8, 9]):
        engine.submit(Request(prompt, SamplingParams(max_new_tokens=6)))
    engine.step()  # both prompts in one step of 8 tokens (a bucket: no padding)
    engine.step()  # two decode tokens (width 2: no padding)
    cost = model_cost(model, model.config.q_heads)
    with FlopCounterMode(display=False) as counter:
        engine.step()
    step = log.steps[-1]
    assert step.segments == [(1, 7), (1, 5)] and step.sampled == 2
    assert step_flops(step, cost) == counter.get_total_flops()


def test_a_step_is_bound_by_bytes_or_flops_whichever_takes_longer():
    cost = ModelCost(body_params=1000, head_params=100, weight_bytes=2200, kv_bytes_per_pos=10, attn_flops_per_pair=8)
    decode = Step([(1, 50), (1, 30)], sampled=2)  # bytes 2200 + 800; flops 2*1000*2 + 2*100*2 + 8*80
    prefill = Step([(400, 400)], sampled=1)
    assert step_bytes(decode, cost) == 3000
    assert step_flops(decode, cost) == 4000 + 400 + 640
    read_gbps, tflops = 1e-6, 1e-9  # 1 kB/s and 1 kFLOP/s
    assert fair_seconds([decode], cost, read_gbps, tflops) == pytest.approx(5.04)  # compute bound
    prefill_s = max(step_bytes(prefill, cost) / 1e3, step_flops(prefill, cost) / 1e3)
    assert fair_seconds([decode, prefill], cost, read_gbps, tflops) == pytest.approx(5.04 + prefill_s)


def test_the_matmul_ceiling_on_a_cpu_is_not_rounded_to_zero():
    """The fair roofline divides by it: a 2-core CPU's few GFLOP/s must survive the rounding."""
    from bench.lib.ceilings import matmul_peak

    peak, variants = matmul_peak(torch.device("cpu"))
    assert 0 < peak == max(variants.values())
