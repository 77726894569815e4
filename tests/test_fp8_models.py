"""e4m3 K/V storage serving models: a tiny transformers Qwen3 teacher-forced against bf16 storage,
the engine and `HFModel` taking `kv_dtype`, and `batchkv run --kv-dtype fp8`."""

from __future__ import annotations

import json

import pytest
import torch

from batchkv import cli, executor
from batchkv.cache import BatchedSequenceCache, CacheConfig
from batchkv.executor import Engine, Request, SamplingParams
from batchkv.models import build_model
from tests.model_loop import greedy_through_cache, run_step, text_idx

transformers = pytest.importorskip("transformers")

from batchkv.models.hf import HFModel  # noqa: E402
from tests.test_models_hf import PROMPTS, _qwen3  # noqa: E402

FP8 = torch.float8_e4m3fn


def teacher_forced_logits(hf, kv_dtype: torch.dtype, tokens: list[int], chunk: int = 32) -> torch.Tensor:
    """float32 [len(tokens), vocab]: next-token logits at every position, the prompt fed in chunks
    through a cache storing K/V as `kv_dtype` (every query reads the stored K/V, its own included)."""
    model = HFModel(hf, kv_dtype=kv_dtype)
    cfg = CacheConfig(**model.cache_spec(), max_seqs=1, capacity=len(tokens), max_write=chunk)
    cache = BatchedSequenceCache(cfg, "cpu", attention="reference")
    seq = cache.seq_new()
    parts = [tokens[s : s + chunk] for s in range(0, len(tokens), chunk)]
    return torch.cat(
        [run_step(model, cache, [(seq, p, text_idx(i * chunk, len(p)))], len(p)) for i, p in enumerate(parts)]
    )


def test_a_qwen3_served_with_e4m3_kv_predicts_what_bf16_storage_predicts():
    # 128 teacher-forced positions of a fp32 Qwen3 with sharp next-token distributions (entropy
    # ~0.7 nats): e4m3 storage against bf16 storage measured mean KL 0.0026 nats and 97.7% top-1
    # agreement; the bounds leave room for other seeds and transformers versions.
    hf = _qwen3()
    tokens = torch.randint(0, 256, (128,), generator=torch.Generator().manual_seed(0)).tolist()
    bf16 = teacher_forced_logits(hf, torch.bfloat16, tokens).log_softmax(-1)
    e4m3 = teacher_forced_logits(hf, FP8, tokens).log_softmax(-1)
    kl = (bf16.exp() * (bf16 - e4m3)).sum(-1)  # KL(bf16 || e4m3) per position, nats
    top1 = (bf16.argmax(-1) == e4m3.argmax(-1)).float().mean()
    assert kl.mean() < 0.01 and top1 >= 0.95
    assert kl.mean() > 0  # e4m3 storage is in play: the logits moved


def test_the_engine_serves_hfmodel_kv_dtype_as_a_hand_written_loop_over_an_e4m3_cache_does():
    hf = _qwen3()
    model = HFModel(hf, kv_dtype=FP8)
    engine = Engine(model, max_seqs=3, capacity=64, max_step_tokens=16, prefill_chunk=4)
    assert engine.cache.config.kv_dtype == FP8 and engine.cache.config.dtype == torch.float32
    max_new = [9, 6, 12]
    ids = [engine.submit(Request(p, SamplingParams(max_new_tokens=n))) for p, n in zip(PROMPTS, max_new, strict=True)]
    tokens: dict[int, list[int]] = {i: [] for i in ids}
    for event in engine.stream():
        if event.token is not None:
            tokens[event.request_id].append(event.token)
    assert [tokens[i] for i in ids] == greedy_through_cache(model, PROMPTS, max_new, max_write=4, bucket=4)
    engine.assert_idle()


def test_the_engine_kv_dtype_argument_overrides_the_models_storage():
    model = build_model("sensenova-u1-tiny", "cpu", seed=0)
    assert Engine(model, max_seqs=2, kv_dtype=FP8).cache.config.kv_dtype == FP8
    assert Engine(model, max_seqs=2).cache.config.kv_dtype == model.cache_spec()["dtype"]


def test_batchkv_run_kv_dtype_fp8_serves_a_workload_on_e4m3_storage(tmp_path, capsys, monkeypatch):
    built = []  # each engine's storage dtype, recorded when it is built (run closes its engine)

    def engine(*args, **kwargs) -> Engine:
        made = Engine(*args, **kwargs)
        built.append(made.cache.config.kv_dtype)
        return made

    monkeypatch.setattr(executor, "Engine", engine)
    out = tmp_path / "metrics.json"
    argv = ["run", "--device", "cpu", "--requests", "4", "--prompt-len", "4:12", "--output-len", "2:6"]
    assert cli.main([*argv, "--kv-dtype", "fp8", "--json", str(out)]) == 0
    assert built == [FP8]
    assert ", kv fp8" in capsys.readouterr().out
    assert json.loads(out.read_text())["generated_tokens"] >= 4 * 2
