"""Keys and values of their own widths on the GPU (run on the H200): DeepSeek-V3's heads (192-wide
keys, 128-wide values) through the Triton kernels against the reference on NaN-poisoned bf16 and
e4m3 stores (split, split_merge and long paths, one captured graph replayed over new tables), and a
DeepSeek-V3 model (random weights, its head widths) served through CUDA graphs decoding what eager
decodes, its store holding the real widths.

    python3 -m pytest -m gpu tests/test_value_dim_gpu.py -q
"""

from __future__ import annotations

import pytest
import torch

from batchkv.ops import sdpa_varlen_reference
from batchkv.ops.reference import quantize_fp8
from tests.test_sdpa_varlen_gpu import table

pytestmark = pytest.mark.gpu

KV_HEADS, GROUP, KEY_DIM, VALUE_DIM = 16, 1, 192, 128  # DeepSeek-V3's expanded heads, 16 of a TP-8 shard's


def stores(rows, lengths, cols, gen, dtype=torch.bfloat16):
    """K [rows, 65, Hkv, 192] and V [rows, 65, Hkv, 128]: random over each column's resident history,
    NaN everywhere else."""
    k = torch.full((rows, 65, KV_HEADS, KEY_DIM), float("nan"), dtype=dtype, device="cuda")
    v = torch.full((rows, 65, KV_HEADS, VALUE_DIM), float("nan"), dtype=dtype, device="cuda")
    for col, end in zip(cols, lengths, strict=True):
        t = torch.arange(max(0, end - rows), end, device="cuda") % rows
        k[t, col] = torch.randn(len(t), KV_HEADS, KEY_DIM, generator=gen, device="cuda").to(dtype)
        v[t, col] = torch.randn(len(t), KV_HEADS, VALUE_DIM, generator=gen, device="cuda").to(dtype)
    return k, v


def run_case(q_lens, kv_ends, *, rows, e4m3=False, config=None, seed=0, extras=None):
    from batchkv.ops.sdpa.launch import _counters, sdpa_varlen
    from batchkv.ops.support import to_scale_layout

    gen = torch.Generator(device="cuda").manual_seed(seed)
    cols = torch.randperm(64, generator=torch.Generator().manual_seed(seed))[: len(q_lens)].tolist()
    k, v = stores(rows, kv_ends, cols, gen)
    info, width = table(q_lens, kv_ends, cols, 2 * len(q_lens))
    q = torch.randn(width + 3, KV_HEADS * GROUP, KEY_DIM, generator=gen, device="cuda").to(torch.bfloat16)
    scales = {}
    if e4m3:
        (k, ks), (v, vs) = quantize_fp8(k), quantize_fp8(v)
        scales = dict(k_scale=to_scale_layout(ks), v_scale=to_scale_layout(vs))
    out = torch.full((q.shape[0], q.shape[1], VALUE_DIM), float("nan"), dtype=q.dtype, device="cuda")
    sdpa_varlen(q, k, v, info, out=out, config=config, **scales, **(extras or {}))
    ref = sdpa_varlen_reference(q, k, v, info, **scales, **(extras or {}))
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=3e-2)
    assert torch.equal(out[width:], torch.zeros_like(out[width:]))
    assert not _counters(q.device, 0).any()


MIXED = ([1, 4, 16, 1, 300, 17, 4], [9100, 4, 2000, 1, 700, 4000, 129])


@pytest.mark.parametrize("e4m3", [False, True])
def test_deepseek_v3_heads_match_reference_on_a_mixed_table(e4m3):
    # e4m3: prompt chunks with exact queries (the default rounds them; the reference here does not)
    from batchkv.ops.sdpa.launch import SdpaConfig

    run_case(*MIXED, rows=9216, e4m3=e4m3, config=SdpaConfig(e4m3_qk_long=False) if e4m3 else None)


def test_deepseek_v3_heads_on_decode_batches_split_merge_and_with_a_cap_and_sinks():
    lengths = torch.randint(64, 8193, (64,), generator=torch.Generator().manual_seed(0)).tolist()
    run_case([1] * 64, lengths, rows=8192)
    for length in (17, 8000):  # the narrow default (split_merge)
        run_case([1], [length], rows=8192)
    sinks = torch.randn(KV_HEADS * GROUP, device="cuda")
    run_case(*MIXED, rows=9216, extras=dict(softcap=30.0, sinks=sinks))


def test_one_captured_graph_replays_new_tables_over_deepseek_v3_heads():
    from batchkv.ops.sdpa.launch import sdpa_varlen

    rows, width = 4096, 24
    gen = torch.Generator(device="cuda").manual_seed(5)
    k = torch.randn(rows, 65, KV_HEADS, KEY_DIM, generator=gen, device="cuda").to(torch.bfloat16)
    v = torch.randn(rows, 65, KV_HEADS, VALUE_DIM, generator=gen, device="cuda").to(torch.bfloat16)
    q = torch.randn(width, KV_HEADS * GROUP, KEY_DIM, generator=gen, device="cuda").to(torch.bfloat16)
    info = torch.zeros(16, 4, dtype=torch.int32, device="cuda")
    out = q.new_empty(width, KV_HEADS * GROUP, VALUE_DIM)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        sdpa_varlen(q, k, v, info, out=out)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sdpa_varlen(q, k, v, info, out=out)
    for mix in [[(1, 5, 4000), (1, 9, 17), (4, 2, 900)], [(16, 9, 33), (1, 40, 1), (1, 63, 4096)], [(20, 7, 4096)]]:
        host = torch.zeros(16, 4, dtype=torch.int32)
        q_start = 0
        for s, (q_len, col, kv_end) in enumerate(mix):
            host[s] = torch.tensor([q_start, q_len, col, kv_end])
            q_start += q_len
        info.copy_(host)
        graph.replay()
        torch.cuda.synchronize()
        ref = sdpa_varlen_reference(q, k, v, info)
        torch.testing.assert_close(out[:q_start].float(), ref[:q_start].float(), atol=2e-2, rtol=2e-2)
        assert torch.equal(out[q_start:], torch.zeros_like(out[q_start:]))


def test_graphs_decode_what_eager_decodes_on_a_deepseek_v3_model_of_real_head_widths():
    transformers = pytest.importorskip("transformers")
    from batchkv.executor import Engine, Request, SamplingParams
    from batchkv.models.hf import HFModel
    from tests.test_model_coverage import _peaky

    cfg = transformers.DeepseekV3Config(
        vocab_size=1024, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=3,
        num_attention_heads=8, num_key_value_heads=8, kv_lora_rank=128, q_lora_rank=None, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=3, max_position_embeddings=2048, pad_token_id=0,  # every layer dense (MLA only)
    )  # fmt: skip
    hf = transformers.DeepseekV3ForCausalLM(cfg)
    hf.generation_config.eos_token_id = None
    model = HFModel(_peaky(hf, seed=2).to("cuda", torch.bfloat16))
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 1024, (int(n),), generator=gen).tolist() for n in (20, 150, 400, 7, 260, 90)]
    tokens = {}
    for use_graphs in (False, True):
        engine = Engine(model, max_seqs=8, capacity=1024, use_graphs=use_graphs, max_step_tokens=256)
        try:
            assert engine.uses_graphs == use_graphs
            assert (engine.cache.config.head_dim, engine.cache.config.value_dim) == (192, 128)
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
