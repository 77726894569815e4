"""The norm and RoPE kernels for transformers models (batchkv.models.hf_norms, hf_rope) compiled on the GPU:
against transformers' op sequences, captured in a CUDA graph, and through HFModel.

Run on the H200: `python3 -m pytest -m gpu tests/test_models_hf_kernels_gpu.py -q`.
"""

from __future__ import annotations

import pytest
import torch

from batchkv.models import fused, hf_norms, hf_rope
from tests.model_loop import make_cache, run_step, text_idx

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")

ULP = 2**-7  # one bf16 ulp, relative


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype and not got.isnan().any()
    torch.testing.assert_close(got.float(), want.float(), rtol=ULP, atol=ULP * want.float().abs().max().item())


def _poisoned(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    n, rows = shape[-1], torch.Size(shape[:-1]).numel()
    buf = torch.full((rows + 2, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(seed)
    buf[1:-1] = (torch.randn(rows, n, generator=g, device="cuda") * 3).to(torch.bfloat16)
    return buf[1:-1].view(shape)


@pytest.mark.parametrize("shape", [(1, 257, 576), (1, 257, 9, 64), (1, 3, 4096)])
@pytest.mark.parametrize(("offset", "round_first"), [(0.0, True), (1.0, False), (0.0, False)])  # Llama, Gemma, Olmo2
def test_the_compiled_norm_kernel_gives_transformers_op_sequence(shape, offset, round_first):
    x = _poisoned(shape, seed=shape[-1])
    w = (1 + 0.2 * torch.randn(shape[-1], device="cuda")).to(torch.bfloat16)
    _close(fused.rms_norm(x, w, 1e-5, offset=offset, round_first=round_first),
           fused.rms_norm_torch(x, w, 1e-5, offset, round_first))  # fmt: skip


@pytest.mark.parametrize(("q_heads", "kv_heads", "d"), [(9, 3, 64), (32, 8, 128)])
def test_the_compiled_rope_kernel_gives_apply_rotary_pos_emb(q_heads, kv_heads, d):
    w = 257
    q = _poisoned((1, w, q_heads, d), seed=1).transpose(1, 2)
    k = _poisoned((1, w, kv_heads, d), seed=2).transpose(1, 2)
    config = transformers.LlamaConfig(head_dim=d, hidden_size=q_heads * d, num_attention_heads=q_heads)
    cos, sin = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config).cuda()(
        q, torch.arange(w, device="cuda")[None] * 7
    )
    want = transformers.models.llama.modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    for got, ref in zip(fused.rope_qk(q, k, cos, sin), want, strict=True):
        _close(got, ref)


def test_both_kernels_replay_from_a_cuda_graph_as_they_run_eagerly():
    x = _poisoned((1, 64, 576), seed=3)
    w = torch.randn(576, device="cuda").to(torch.bfloat16)
    q, k = _poisoned((1, 64, 9, 64), seed=4).transpose(1, 2), _poisoned((1, 64, 3, 64), seed=5).transpose(1, 2)
    cos, sin = torch.rand(2, 1, 64, 64, device="cuda").to(torch.bfloat16)

    def step():
        return (fused.rms_norm(x, w, 1e-5), *fused.rope_qk(q, k, cos, sin))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compiled before the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for t in (x, q, k, cos, sin):  # new inputs in place, then replay
        t.copy_(torch.randn_like(t, dtype=torch.float32).to(t.dtype))
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(outs, step(), strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_hfmodel_logits_with_the_kernels_match_transformers_ops_on_the_gpu(name, monkeypatch):
    from batchkv.models.hf import HFModel

    geometry = {"vocab_size": 256, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32}  # fmt: skip
    make = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
            "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[name]  # fmt: skip
    logits = []
    for fuse in (False, True):
        monkeypatch.setattr(hf_norms, "FUSE", fuse)
        monkeypatch.setattr(hf_rope, "FUSE", fuse)
        torch.manual_seed(0)
        model = HFModel(make[1](make[0](**geometry)).cuda().eval())  # float32: the kernels' only rounding is float32's
        assert any(isinstance(m, hf_norms.FusedRMSNorm) for m in model.hf.modules()) == fuse
        cache = make_cache(model, max_seqs=2)
        prompt = [5, 17, 33, 101, 7, 250, 3]
        logits.append(run_step(model, cache, [(cache.seq_new(), prompt, text_idx(0, len(prompt)))], width=8))
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-4)
