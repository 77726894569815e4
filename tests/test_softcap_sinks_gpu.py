"""Soft-capping and sinks on the GPU (run on the H200): the Triton kernels at Gemma2 and gpt-oss head
shapes against the reference on NaN-poisoned stores (bf16 and e4m3, split, split_merge and long
paths, one captured graph replayed over new tables), and Gemma2 and gpt-oss models (random weights,
their attention shapes) served through CUDA graphs decoding what eager decodes.

    python3 -m pytest -m gpu tests/test_softcap_sinks_gpu.py -q
"""

from __future__ import annotations

import pytest
import torch

from batchkv.ops import sdpa_varlen_reference
from batchkv.ops.reference import dequantize_fp8, quantize_fp8, quantize_queries
from tests.test_sdpa_varlen_gpu import poisoned_store, table

pytestmark = pytest.mark.gpu

# (kv heads, group, head dim, window): Gemma2-9B's attention, gpt-oss-20b's
SHAPES = {"gemma2": (8, 2, 256, 4096), "gpt-oss": (8, 8, 64, 128)}
EXTRAS = {"gemma2": dict(softcap=50.0), "gpt-oss": dict(sinks=True), "both": dict(softcap=20.0, sinks=True)}


def run_case(shape, extras, q_lens, kv_ends, *, rows, e4m3=False, seed=0, config=None, atol=2e-2):
    from batchkv.ops.sdpa.launch import _counters, sdpa_varlen
    from batchkv.ops.support import to_scale_layout

    kv_heads, group, head_dim, window = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    cols = torch.randperm(64, generator=torch.Generator().manual_seed(seed))[: len(q_lens)].tolist()
    k, v = poisoned_store(rows, kv_heads, head_dim, torch.bfloat16, kv_ends, cols, gen)
    info, width = table(q_lens, kv_ends, cols, 2 * len(q_lens))
    q = torch.randn(width + 3, kv_heads * group, head_dim, generator=gen, device="cuda").to(torch.bfloat16)
    kw = dict(extras)
    if kw.pop("sinks", False):
        kw["sinks"] = 2.0 * torch.randn(kv_heads * group, generator=gen, device="cuda")
    stores = dict(k_scale=None, v_scale=None)
    q_ref = q
    if e4m3:
        (k, ks), (v, vs) = quantize_fp8(k), quantize_fp8(v)
        stores = dict(k_scale=to_scale_layout(ks), v_scale=to_scale_layout(vs))
        if not kw.get("softcap") and config is None:  # the default rounds prompt chunks' queries (not under a cap)
            q_ref = q.float().clone()
            rounded = dequantize_fp8(*quantize_queries(q))
            for q_start, q_len, _, _ in info.tolist():
                if q_len > 16:
                    q_ref[q_start : q_start + q_len] = rounded[q_start : q_start + q_len]
    out = torch.full_like(q, float("nan"))
    sdpa_varlen(q, k, v, info, window=window, out=out, config=config, **stores, **kw)
    ref = sdpa_varlen_reference(q_ref, k, v, info, window=window, **stores, **kw)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=atol)
    assert torch.equal(out[width:], torch.zeros_like(out[width:]))
    assert not _counters(q.device, 0).any()


@pytest.mark.parametrize("extras", list(EXTRAS))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_mixed_table_of_decode_verify_and_prefill_matches_reference(shape, extras):
    run_case(shape, EXTRAS[extras], [1, 4, 16, 1, 300, 17, 4], [9100, 4, 2000, 1, 700, 4000, 129], rows=9216)


@pytest.mark.parametrize("extras", list(EXTRAS))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_decode_batches_and_one_sequence_split_over_every_program_match_reference(shape, extras):
    lengths = torch.randint(64, 8193, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    run_case(shape, EXTRAS[extras], [1] * 64, lengths, rows=8192)
    for length in (17, 1024, 8000):  # the narrow default (split_merge): every program, one merge
        run_case(shape, EXTRAS[extras], [1], [length], rows=8192)


@pytest.mark.parametrize("extras", list(EXTRAS))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_e4m3_stores_match_reference_on_their_codes(shape, extras):
    run_case(shape, EXTRAS[extras], [1, 4, 1, 300, 64], [5000, 300, 1, 700, 2000], rows=8192, e4m3=True, atol=3e-2)


def test_the_main_path_configs_with_several_heads_and_tma_match_reference():
    from batchkv.ops.sdpa.launch import SdpaConfig

    for overrides in ({"heads": 2}, {"heads": 4}, {"tma_long": True}, {"warp_split": 2}, {"split_merge": True}):
        run_case("gpt-oss", EXTRAS["both"], [1, 3, 1, 2], [4000, 300, 64, 3000], rows=4096,
                 config=SdpaConfig(**overrides))  # fmt: skip
    run_case("gemma2", EXTRAS["both"], [200, 1, 40], [900, 64, 3000], rows=4096, config=SdpaConfig(tma_long=True))


def test_one_captured_graph_replays_new_tables_with_a_cap_and_sinks():
    from batchkv.ops.sdpa.launch import sdpa_varlen

    kv_heads, group, head_dim, window = SHAPES["gpt-oss"]
    rows, width = 4096, 24
    gen = torch.Generator(device="cuda").manual_seed(5)
    k = torch.randn(rows, 65, kv_heads, head_dim, generator=gen, device="cuda").to(torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(width, kv_heads * group, head_dim, generator=gen, device="cuda").to(torch.bfloat16)
    sinks = torch.randn(kv_heads * group, generator=gen, device="cuda")
    info = torch.zeros(16, 4, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    kw = dict(window=window, softcap=30.0, sinks=sinks)
    mixes = [[(1, 5, 4000), (1, 9, 17), (4, 2, 900)], [(16, 9, 33), (1, 40, 1), (1, 63, 4096)], [(1, 7, 4096)]]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        sdpa_varlen(q, k, v, info, out=out, **kw)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sdpa_varlen(q, k, v, info, out=out, **kw)
    for mix in mixes:
        host = torch.zeros(16, 4, dtype=torch.int32)
        q_start = 0
        for s, (q_len, col, kv_end) in enumerate(mix):
            host[s] = torch.tensor([q_start, q_len, col, kv_end])
            q_start += q_len
        info.copy_(host)
        graph.replay()
        torch.cuda.synchronize()
        ref = sdpa_varlen_reference(q, k, v, info, **kw)
        torch.testing.assert_close(out[:q_start].float(), ref[:q_start].float(), atol=2e-2, rtol=2e-2)
        assert torch.equal(out[q_start:], torch.zeros_like(out[q_start:]))


class _DenseMLP(torch.nn.Module):
    """A dense stand-in for gpt-oss's experts ((h, router scores) out, as its decoder layer unpacks)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(hidden, 2 * hidden)
        self.down = torch.nn.Linear(2 * hidden, hidden)

    def forward(self, h):
        return self.down(torch.nn.functional.silu(self.up(h))), None


def _model(name: str, dense_mlp: bool = False):
    transformers = pytest.importorskip("transformers")
    from tests.test_model_coverage import _peaky

    common = dict(vocab_size=1024, hidden_size=512, num_hidden_layers=4, max_position_embeddings=4096, pad_token_id=0)
    if name == "gemma2":
        cfg = transformers.Gemma2Config(**common, intermediate_size=1024, num_attention_heads=16, num_key_value_heads=8,
                                        head_dim=256, sliding_window=64, query_pre_attn_scalar=256,
                                        attn_logit_softcapping=50.0, final_logit_softcapping=30.0)  # fmt: skip
        hf = transformers.Gemma2ForCausalLM(cfg)
    else:
        cfg = transformers.GptOssConfig(**common, intermediate_size=256, num_attention_heads=64, num_key_value_heads=8,
                                        head_dim=64, sliding_window=128, num_local_experts=4,
                                        num_experts_per_tok=2)  # fmt: skip
        hf = transformers.GptOssForCausalLM(cfg)
        if dense_mlp:
            for layer in hf.model.layers:
                layer.mlp = _DenseMLP(512)
    hf.generation_config.eos_token_id = None
    return _peaky(hf, seed=2).to("cuda", torch.bfloat16)


@pytest.mark.parametrize(("name", "dense_mlp"), [("gemma2", False), ("gpt-oss", True), ("gpt-oss", False)])
def test_graphs_decode_what_eager_decodes_at_gemma2_and_gpt_oss_shapes(name, dense_mlp):
    from batchkv.executor import Engine, Request, SamplingParams
    from batchkv.models.hf import HFModel

    model = HFModel(_model(name, dense_mlp))
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 1024, (int(n),), generator=gen).tolist() for n in (20, 150, 400, 7, 260, 90)]
    tokens = {}
    for use_graphs in (False, True):
        engine = Engine(model, max_seqs=8, capacity=1024, use_graphs=use_graphs, max_step_tokens=256)
        try:
            assert engine.uses_graphs == use_graphs
            params = SamplingParams(max_new_tokens=16, ignore_eos=True)
            ids = [engine.submit(Request(p, params)) for p in prompts]
            got: dict[int, list[int]] = {i: [] for i in ids}
            for event in engine.run_until_done():
                got[event.request_id].append(event.token)
            tokens[use_graphs] = [got[i] for i in ids]
        finally:
            engine.close()
    assert tokens[True] == tokens[False]
    assert all(len(t) == 16 for t in tokens[True])
