"""The norm kernel with transformers' residual add and the e4m3 quantiser compiled on the GPU
(`batchkv.models.hf_layers`, `batchkv.models.quant.producers.rms_norm_quant`): the separate passes' bits
at the 8B shape, and a Llama's steps through HFModel, eager and replayed from a CUDA graph, against the
same model with the layers as transformers has them and the layers quantising for themselves.

Run on the H200: `python3 -m pytest -m gpu tests/test_models_hf_layers_gpu.py -q`.
"""

from __future__ import annotations

import copy

import pytest
import torch

from batchkv.models import fused, hf_layers, hf_norms
from batchkv.models.hf_norms import residual_rms_norm
from batchkv.models.quant import producers
from batchkv.models.quant.fp8 import quantize_rows

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")

# Llama's form, the one hf_layers hands codes and sums from (compiled for the H200, Gemma's (1.0, False)
# and Olmo2's (0.0, False) gave norms and codes 1 ulp apart from the separate passes' at 256+ rows, so
# hf_layers leaves those layers alone; the interpreter's bits are tested for all three on the CPU)
FORMS = [(0.0, True)]


def _poisoned(rows: int, n: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    buf = torch.full((rows + 2, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(seed)
    buf[1:-1] = (torch.randn(rows, n, generator=g, device="cuda") * scale).to(torch.bfloat16)
    return buf[1:-1]


def _same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("rows", [1, 5, 256, 1024])
@pytest.mark.parametrize("add", [False, True])
@pytest.mark.parametrize(("offset", "round_first"), FORMS)
def test_the_norm_kernel_writes_the_separate_passes_sum_norm_and_codes_bit_for_bit(rows, add, offset, round_first):
    x, delta = _poisoned(rows, 4096, seed=rows), _poisoned(rows, 4096, seed=rows + 1, scale=1.0)
    w = (1 + 0.2 * torch.randn(4096, device="cuda")).to(torch.bfloat16)
    if rows > 2:
        x[1, 9] = float("nan")
        x[2], delta[2] = 1.0, -1.0  # a row of zeros after the add
    kw = {"offset": offset, "round_first": round_first}
    assert producers.fused(x)  # this GPU quantises in the producers
    h, out, (q, s) = producers.rms_norm_quant(x, w, 1e-5, delta=delta if add else None, **kw)
    if add:
        h_ref = x + delta  # torch's add
        _same(h, h_ref)
        _same(residual_rms_norm(x, delta, w, 1e-5, **kw)[1], out)  # the kernel without the quantiser
    else:
        h_ref = x
    _same(fused.rms_norm(h_ref, w, 1e-5, **kw), out)
    q_ref, s_ref = quantize_rows(out)  # the separate quantiser (Triton)
    _same(s, s_ref)
    finite = ~s_ref.isnan().flatten()
    assert torch.equal(q[finite].view(torch.uint8), q_ref[finite].view(torch.uint8))
    torch.testing.assert_close(out.float(), fused.rms_norm_torch(h_ref, w, 1e-5, **kw).float(), equal_nan=True,
                               rtol=2**-7, atol=2**-7)  # transformers' ops: one bf16 ulp  # fmt: skip


def _llama(fp8: bool) -> torch.nn.Module:
    from batchkv.models.hf import quantize_decoder

    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=64)  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.2 * torch.randn_like(p))
    if fp8:
        quantize_decoder(hf)
    return hf


@pytest.mark.parametrize("fp8", [False, True])
def test_a_llama_step_replays_from_a_graph_and_equals_the_layers_as_transformers_has_them(fp8, monkeypatch):
    from batchkv.models.hf import HFModel
    from tests.test_models_graph_safety import _capture_and_replay

    base = _llama(fp8)
    model = HFModel(copy.deepcopy(base))
    assert "forward" in model.hf.model.layers[0].__dict__  # adapted
    replayed, eager = _capture_and_replay(model, width=64, rows=8)
    torch.testing.assert_close(replayed, eager)
    monkeypatch.setattr(hf_layers, "FUSE", False)  # the other fusions alone: adds apart, quantisers apart
    plain = HFModel(copy.deepcopy(base))
    assert "forward" not in plain.hf.model.layers[0].__dict__
    separate = _capture_and_replay(plain, width=64, rows=8)[1]
    assert torch.equal(eager, separate)  # eager both: the same roundings, the same bits
    if fp8:
        monkeypatch.setattr(hf_norms, "QUANT", False)  # the residual adds fused, the quantisers apart
        assert torch.equal(_capture_and_replay(model, width=64, rows=8)[1], eager)


@pytest.mark.parametrize("overlap", [False, True])
def test_an_fp8_llama_served_with_graphs_decodes_the_tokens_of_its_layers_as_transformers_has_them(
    overlap, monkeypatch
):
    from batchkv.models.hf import HFModel
    from tests.test_quant_gpu import _decode

    base = _llama(True)
    fused_tokens = _decode(HFModel(copy.deepcopy(base)), use_graphs=True, overlap=overlap)
    monkeypatch.setattr(hf_layers, "FUSE", False)
    assert fused_tokens == _decode(HFModel(copy.deepcopy(base)), use_graphs=True, overlap=overlap)
