"""batchkv.compat on the CPU: the SenseNova paged-decode surface against the pipeline's eager loop.

The oracle is the same tiny model decoding on a transformers DynamicCache with torch SDPA
(tests/pipeline_lm.py). Graph keying is checked with a recording stand-in for GraphSet.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import DynamicCache

import batchkv.executor.graphs as graph_module
from batchkv import compat
from batchkv.compat import DecodeGraphRunner, PagedDecodeCache
from batchkv.errors import CapacityError, ConfigError, ContractError, StepError
from tests.pipeline_lm import PipelineLM, eager_loop, paged_loop

SMALL = dict(buckets=(8, 16), tail_step=8)


class RecordingGraphs:
    """GraphSet's interface on the CPU: a capture records its key, a replay reruns the step."""

    def __init__(self) -> None:
        self.captures, self.replays, self.keys, self._live = 0, 0, [], set()

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, key) -> bool:
        return key in self._live

    def run(self, key, fn):
        if key not in self._live:
            self._live.add(key)
            self.keys.append(key)
            self.captures += 1
        self.replays += 1
        return fn()

    def retain(self, keep) -> None:
        self._live = {key for key in self._live if keep(key)}


def request(seed: int, prompt_len: int, steps: int, vocab: int = 61) -> tuple[torch.Tensor, list[int]]:
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab, (prompt_len,), generator=gen)
    return prompt, torch.randint(0, vocab, (steps,), generator=gen).tolist()


def assert_same_run(want, got) -> None:
    """Logits at every step and the final DynamicCache of two loops agree."""
    (want_logits, want_cache), (got_logits, got_cache) = want, got
    assert len(want_logits) == len(got_logits)
    for step, (a, b) in enumerate(zip(want_logits, got_logits, strict=True)):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5, msg=lambda m, step=step: f"step {step}: {m}")
    for a, b in zip(want_cache.layers, got_cache.layers, strict=True):
        assert a.keys.shape == b.keys.shape
        torch.testing.assert_close(b.keys, a.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(b.values, a.values, atol=1e-5, rtol=1e-5)


def dyn_cache(n: int, layers: int = 2, kv_heads: int = 2, head_dim: int = 16, batch: int = 1) -> DynamicCache:
    cache = DynamicCache()
    for i in range(layers):
        cache.update(torch.randn(batch, kv_heads, n, head_dim), torch.randn(batch, kv_heads, n, head_dim), i)
    return cache


def test_the_paged_loop_gives_the_eager_logits_at_every_step_and_the_same_final_cache():
    lm = PipelineLM().eval()
    prompt, tokens = request(0, 5, 20)
    graphs = RecordingGraphs()
    logits, dyn, (paged, runner) = paged_loop(lm, prompt, tokens, graphs=graphs, **SMALL)
    assert_same_run(eager_loop(lm, prompt, tokens), (logits, dyn))
    assert paged.bucket == 32 and paged.length == 25  # 8 -> 16 -> 24 -> 32: three boundaries crossed
    assert runner.captures == len({key[:2] for key in graphs.keys}) == 4  # one per (bucket, generation)
    assert graphs.replays == 20 and len(graphs) == 1  # stale generations were dropped


def test_a_second_request_reuses_the_buffers_and_the_captures():
    lm = PipelineLM().eval()
    prompt, tokens = request(1, 5, 20)
    _, _, context = paged_loop(lm, prompt, tokens, graphs=RecordingGraphs(), **SMALL)
    paged, runner = context
    generation, captures = paged.generation, runner.captures
    storage = [paged.inner.k_store(i).data_ptr() for i in range(lm.num_layers)]
    prompt2, tokens2 = request(2, 7, 6)  # 13 positions: fits the 32 rows left by the first request
    logits, dyn, context2 = paged_loop(lm, prompt2, tokens2, context=context)
    assert context2[0] is paged and context2[1] is runner
    assert paged.generation == generation and runner.captures == captures
    assert [paged.inner.k_store(i).data_ptr() for i in range(lm.num_layers)] == storage
    assert_same_run(eager_loop(lm, prompt2, tokens2), (logits, dyn))


def test_reusable_for_refuses_other_geometry_dtype_or_a_longer_request():
    paged = PagedDecodeCache(2, 2, 16, 10, "cpu", torch.float32, **SMALL)
    assert paged.bucket == 16
    assert paged.reusable_for(2, 2, 16, torch.float32, 16)
    for args in ((3, 2, 16, torch.float32, 9), (2, 4, 16, torch.float32, 9), (2, 2, 32, torch.float32, 9)):
        assert not paged.reusable_for(*args)
    assert not paged.reusable_for(2, 2, 16, torch.bfloat16, 9)
    assert not paged.reusable_for(2, 2, 16, torch.float32, 17)


def test_the_default_schedule_is_the_originals_and_costs_one_allocation_to_build():
    paged = PagedDecodeCache(1, 1, 16, 9100, "cpu", torch.float32)
    assert (compat.BUCKETS, compat.TAIL_STEP) == ((512, 1024, 2048, 4096, 8192), 2048)
    assert [paged.bucket_for(n) for n in (1, 512, 513, 8192, 8193, 9100, 10241)] == [
        512, 512, 1024, 8192, 10240, 10240, 12288,
    ]  # fmt: skip
    assert paged.bucket == 10240 and paged.generation == 1
    # Past the last bucket, 1024 decode steps cost at most one reallocation from any start.
    for start in (8193, 8192 + 2047, 8192 + 2048 + 7):
        assert len({paged.bucket_for(n) for n in range(start, start + 1025)}) <= 2


@pytest.mark.parametrize("error", [torch.OutOfMemoryError, RuntimeError])
def test_grow_is_atomic_when_an_allocation_fails_and_bumps_generation_when_it_succeeds(error):
    calls = {"n": 0, "fail_at": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == calls["fail_at"]:
            raise error("injected")
        return torch.empty(*args, **kwargs)

    paged = PagedDecodeCache.from_dynamic_cache(dyn_cache(7), 2, "cpu", torch.float32, alloc=flaky, **SMALL)
    before = (paged.bucket, paged.generation, paged.length, paged.pos.tolist(), paged.seqused.tolist())
    stores = [(paged.inner.k_store(i), paged.inner.v_store(i)) for i in range(2)]
    kept = [k[:7].clone() for k in paged.k]
    calls["n"], calls["fail_at"] = 0, 4  # the last of 2 layers x (K, V)
    with pytest.raises(CapacityError if error is torch.OutOfMemoryError else error, match="injected"):
        paged.grow(9)
    assert (paged.bucket, paged.generation, paged.length, paged.pos.tolist(), paged.seqused.tolist()) == before
    assert all(paged.inner.k_store(i) is k and paged.inner.v_store(i) is v for i, (k, v) in enumerate(stores))
    calls["fail_at"] = 0
    assert paged.grow(9) is True
    assert paged.bucket == 16 and paged.generation == before[1] + 1
    assert paged.pos.tolist() == [6] and paged.seqused.tolist() == [7]  # the staged step survives growth
    assert all(torch.equal(k[:7], old) for k, old in zip(paged.k, kept, strict=True))
    assert paged.grow(16) is False and paged.generation == before[1] + 1


def test_set_length_stages_the_slot_and_length_and_attend_reads_exactly_that_prefix():
    paged = PagedDecodeCache.from_dynamic_cache(dyn_cache(6), 2, "cpu", torch.float32, **SMALL)
    paged.set_length(5)  # back: position 4 is rewritten by the next attend
    assert paged.pos.tolist() == [4] and paged.seqused.tolist() == [5]
    for k, v in zip(paged.k, paged.v, strict=True):
        k[5:].fill_(float("nan"))  # nothing at or past the length may be read
        v[5:].fill_(float("nan"))
    q, k, v = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16)
    out = paged.attend(1, q, k, v, 0.3)
    assert out.shape == (1, 1, 4, 16)
    assert torch.equal(paged.k[1][4], k[0, :, 0]) and torch.equal(paged.v[1][4], v[0, :, 0])
    keys, values = paged.k[1][:5].transpose(0, 1)[None], paged.v[1][:5].transpose(0, 1)[None]
    want = F.scaled_dot_product_attention(q, keys, values, scale=0.3, enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    # the protocol batchkv's own models use reaches the same store and staged step
    again = paged.update_and_attend(1, q.reshape(1, 4, 16), k.reshape(1, 2, 16), v.reshape(1, 2, 16), scale=0.3)
    torch.testing.assert_close(again, out.reshape(1, 4, 16), atol=0, rtol=0)
    generation = paged.generation
    paged.set_length(12)  # past the bucket: grows, as grow(12) would
    assert paged.bucket == 16 and paged.generation == generation + 1 and paged.seqused.tolist() == [12]
    paged.set_length(0)
    with pytest.raises(StepError):
        paged.attend(0, q, k, v, 0.3)


def test_empty_caches_give_none_and_false_and_a_batch_of_two_is_refused():
    assert PagedDecodeCache.from_dynamic_cache(DynamicCache(), 2, "cpu", torch.float32) is None
    duck = types.SimpleNamespace(layers=[types.SimpleNamespace(keys=None, values=None)])
    assert PagedDecodeCache.from_dynamic_cache(duck, 1, "cpu", torch.float32) is None
    paged = PagedDecodeCache.from_dynamic_cache(dyn_cache(3), 2, "cpu", torch.float32, **SMALL)
    assert paged.load_prefix(DynamicCache()) is False and paged.length == 3
    with pytest.raises(ContractError, match="batch 1"):
        paged.load_prefix(dyn_cache(4, batch=2))
    assert paged.length == 3 and paged.seqused.tolist() == [3]


def test_load_prefix_checks_every_layer_not_only_the_first_and_a_refusal_changes_nothing():
    paged = PagedDecodeCache.from_dynamic_cache(dyn_cache(3), 2, "cpu", torch.float32, **SMALL)
    k0 = paged.k[0].clone()
    good, wide = dyn_cache(4).layers[0], dyn_cache(4, batch=2).layers[1]
    lazy = types.SimpleNamespace(keys=None, values=None)  # a layer transformers has not filled yet
    for second, why in ((wide, r"layer 1 keys .*\[2, 2, 4, 16\]"), (lazy, "layer 1 keys .*None")):
        with pytest.raises(ContractError, match=why):  # was: batch row 0 taken silently, or a TypeError
            paged.load_prefix(types.SimpleNamespace(layers=[good, second]))
        assert paged.length == 3 and torch.equal(paged.k[0].view(torch.int32), k0.view(torch.int32))  # bits: rows
        # past the history hold whatever the allocator gave, NaN patterns included


def test_to_dynamic_cache_fills_a_fresh_lazy_cache_that_then_grows_as_usual():
    source = dyn_cache(9)
    paged = PagedDecodeCache.from_dynamic_cache(source, 2, "cpu", torch.float32, **SMALL)
    fresh = DynamicCache()
    paged.to_dynamic_cache(fresh)
    assert fresh.get_seq_length() == 9
    for a, b in zip(source.layers, fresh.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    k = torch.randn(1, 2, 1, 16)
    assert fresh.update(k, k, 0)[0].shape == (1, 2, 10, 16)
    with pytest.raises(ContractError, match="layers"):
        paged.to_dynamic_cache(types.SimpleNamespace(layers=[]))


class Wrapper(nn.Module):
    """What a LoRA manager leaves in the tree: a wrapper around the base linear layer."""

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.base_layer = base

    def forward(self, x):
        return self.base_layer(x)


class FakeLoRA(Wrapper):
    """A wrapper class the tests register."""


def test_adapter_wrappers_are_recognised_when_registered_or_defined_by_vllm_or_peft(monkeypatch):
    monkeypatch.setattr(graph_module, "_registered", [])
    lm = PipelineLM()
    assert not compat.dynamic_lora_wrappers_present(lm)
    lm.layers[0].self_attn.q_proj = FakeLoRA(lm.layers[0].self_attn.q_proj)
    assert not compat.dynamic_lora_wrappers_present(lm)
    assert compat.register_adapter_wrapper(FakeLoRA) is FakeLoRA
    assert compat.dynamic_lora_wrappers_present(lm)
    for module_name, attr in (("vllm.lora.layers", "BaseLayerWithLoRA"), ("peft.tuners.lora", "LoraLayer")):
        wrapper = type(attr, (Wrapper,), {})  # not a FakeLoRA: found through sys.modules only
        monkeypatch.setitem(sys.modules, module_name, types.SimpleNamespace(**{attr: wrapper}))
        plain = PipelineLM()
        assert not compat.dynamic_lora_wrappers_present(plain)
        plain.layers[1].up = wrapper(plain.layers[1].up)
        assert wrapper in compat.adapter_wrapper_classes() and compat.dynamic_lora_wrappers_present(plain)


def test_the_runner_goes_eager_and_drops_its_graphs_once_an_adapter_wrapper_appears(monkeypatch):
    monkeypatch.setattr(graph_module, "_registered", [])
    compat.register_adapter_wrapper(FakeLoRA)
    lm = PipelineLM().eval()
    prompt, tokens = request(3, 5, 9)
    want, _ = eager_loop(lm, prompt, tokens)
    graphs = RecordingGraphs()
    got, _, (paged, runner) = paged_loop(lm, prompt, tokens[:3], graphs=graphs, min_length=16, **SMALL)
    generation = paged.generation  # 16 rows hold the whole request: no growth below
    assert runner.uses_graphs() and graphs.captures == 1 and graphs.replays == 3
    attn = lm.layers[0].self_attn
    base = attn.q_proj
    attn.q_proj = FakeLoRA(base)  # a LoRA manager wraps a layer mid-service
    assert not runner.uses_graphs()
    for i, token in enumerate(tokens[3:6], start=3):
        paged.set_length(paged.length + 1)
        got.append(runner.step(token, len(prompt) + i)[0, -1].clone())
    assert len(graphs) == 0 and graphs.captures == 1 and graphs.replays == 3 and runner.eager_steps == 3
    attn.q_proj = base  # unwrapped again: the graphs taken before the adapter are gone, so it captures anew
    for i, token in enumerate(tokens[6:], start=6):
        paged.set_length(paged.length + 1)
        got.append(runner.step(token, len(prompt) + i)[0, -1].clone())
    assert graphs.captures == 2 and graphs.replays == 6 and paged.generation == generation
    for a, b in zip(want, got, strict=True):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


def test_without_cuda_the_runner_runs_every_step_eagerly_and_paged_decode_is_unsupported():
    lm = PipelineLM().eval()
    paged = PagedDecodeCache.from_dynamic_cache(dyn_cache(4, 3), 3, "cpu", torch.float32, **SMALL)
    runner = DecodeGraphRunner(lm, paged, "cpu")
    paged.set_length(5)
    assert runner.step(3, 4).shape == (1, 1, 61)
    assert not runner.uses_graphs() and runner.captures == 0 and runner.eager_steps == 1
    assert not compat.paged_decode_supported(torch.device("cpu"), 128)


def test_a_step_after_set_length_zero_is_refused_before_anything_runs():
    lm = PipelineLM().eval()
    paged = PagedDecodeCache.from_dynamic_cache(dyn_cache(4, 3), 3, "cpu", torch.float32, **SMALL)
    graphs = RecordingGraphs()
    runner = DecodeGraphRunner(lm, paged, "cpu", graphs=graphs)
    paged.set_length(5)
    runner.step(3, 4)
    paged.set_length(0)
    with pytest.raises(StepError, match="set_length"):
        runner.step(3, 4)  # a replay would overwrite the last staged slot
    assert graphs.replays == 1


def test_paged_decode_is_supported_for_head_dims_that_are_multiples_of_16_up_to_256(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(compat.ops, "triton_available", lambda device: True)
    monkeypatch.setattr(compat.ops, "backend_functions", lambda name: (None, None))
    supported = [d for d in (8, 16, 24, 64, 96, 128, 192, 256, 512) if compat.paged_decode_supported("cuda", d)]
    assert supported == [16, 64, 96, 128, 192, 256]  # the kernels' tiles are the next power of two, masked

    def not_built(name):
        raise ConfigError(f"attention backend {name!r} is not built yet")

    monkeypatch.setattr(compat.ops, "backend_functions", not_built)
    assert not compat.paged_decode_supported("cuda", 128)  # no Triton kernel built: not supported


def test_batchkv_sensenova_runs_on_the_facade_through_the_pipeline_signature():
    pytest.importorskip("batchkv.models.sensenova", reason="batchkv.models.sensenova is not in this tree")
    from batchkv.models import build_model
    from tests.pipeline_lm import sensenova_runs

    model = build_model("sensenova-u1-tiny", "cpu", seed=0)
    prompt, tokens = request(4, 6, 7, vocab=model.config.vocab)
    (want, past), (got, dyn), runner = sensenova_runs(model, prompt, tokens, buckets=(8,), tail_step=4)
    assert runner.eager_steps == 7 and dyn.get_seq_length() == 13
    for a, b in zip(want, got, strict=True):
        torch.testing.assert_close(b, a, atol=1e-3, rtol=1e-4)
    for (k, v), layer in zip(past, dyn.layers, strict=True):
        torch.testing.assert_close(layer.keys, k[None], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(layer.values, v[None], atol=1e-4, rtol=1e-4)
