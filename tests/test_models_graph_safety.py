"""The model forwards are static given W and R: they run on meta tensors (no values to read) and
capture in a CUDA graph (GPU). A stand-in cache records the calls and returns q-shaped output.
"""

from __future__ import annotations

import pytest
import torch

from batchkv.models import MODEL_PRESETS, SenseNovaLM, build_model


class RecordingCache:
    """Stands in for BatchedSequenceCache: records each call, returns `q` scaled (capturable)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, tuple, tuple, tuple, float | None]] = []

    def update_and_attend(self, layer, q, k, v, scale=None, causal=True):
        self.calls.append((layer, tuple(q.shape), tuple(k.shape), tuple(v.shape), scale))
        return q * 0.5


def _inputs(width: int, rows: int, vocab: int, device: str):
    ids = torch.zeros(width, dtype=torch.int64, device=device)
    idx = torch.zeros(3, width, dtype=torch.int64, device=device)
    return ids, idx, torch.arange(rows, device=device)


@pytest.mark.parametrize("preset", ["sensenova-u1-tiny", "sensenova-u1-8b"])
def test_the_sensenova_forward_runs_on_meta_tensors_with_static_shapes(preset):
    cfg = MODEL_PRESETS[preset]
    model = SenseNovaLM(cfg, "meta")
    cache = RecordingCache()
    out = model(*_inputs(24, 5, cfg.vocab, "meta")[:2], cache, torch.arange(5, device="meta"))
    assert (out.shape, out.dtype, out.device.type) == ((5, cfg.vocab), torch.float32, "meta")
    d = cfg.head_dim
    assert cache.calls == [
        (layer, (24, cfg.q_heads, d), (24, cfg.kv_heads, d), (24, cfg.kv_heads, d), d**-0.5)
        for layer in range(cfg.num_layers)
    ]


def _tiny_qwen3():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        attn_implementation="sdpa",
    )
    return transformers.Qwen3ForCausalLM(cfg)


def test_the_transformers_adapter_runs_on_meta_tensors_with_static_shapes():
    from batchkv.models.hf import HFModel

    model = HFModel(_tiny_qwen3().to("meta"))
    cache = RecordingCache()
    ids, idx, rows = _inputs(12, 3, 256, "meta")
    out = model(ids, idx, cache, rows)
    assert (out.shape, out.dtype, out.device.type) == ((3, 256), torch.float32, "meta")
    assert [c[:4] for c in cache.calls] == [(layer, (12, 4, 16), (12, 2, 16), (12, 2, 16)) for layer in range(2)]


def _capture_and_replay(model, width: int, rows: int):
    """Capture one step, replay it on new inputs; returns (replayed, eager) logits."""
    dev = "cuda"
    ids, idx, sel = _inputs(width, rows, model.vocab_size, dev)
    cache = RecordingCache()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        model(ids, idx, cache, sel)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = model(ids, idx, cache, sel)
    gen = torch.Generator().manual_seed(0)
    ids.copy_(torch.randint(0, model.vocab_size, (width,), generator=gen))
    idx.copy_(torch.randint(0, 50, (3, width), generator=gen))
    sel.copy_(torch.randperm(width, generator=gen)[:rows])
    graph.replay()
    return static_out.clone(), model(ids, idx, cache, sel)


@pytest.mark.gpu
def test_the_sensenova_forward_captures_in_a_cuda_graph_and_replays_new_inputs():
    model = build_model("sensenova-u1-tiny", "cuda", seed=0)
    replayed, eager = _capture_and_replay(model, width=16, rows=4)
    torch.testing.assert_close(replayed, eager)


@pytest.mark.gpu
def test_the_transformers_adapter_captures_in_a_cuda_graph_and_replays_new_inputs():
    from batchkv.models.hf import HFModel

    replayed, eager = _capture_and_replay(HFModel(_tiny_qwen3().to("cuda")), width=16, rows=4)
    torch.testing.assert_close(replayed, eager)
