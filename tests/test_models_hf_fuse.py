"""Fused q/k/v and gate/up projections of transformers decoders (`batchkv.models.hf_fuse`): the tiny
random models of the coverage matrix (`tests/test_model_coverage.py`) served fused give transformers'
own greedy tokens and the unfused model's logits, in float and in FP8 (the CPU emulation), one GEMM a
group per step; what is not fusable is left as it was; state dicts keep the unfused names."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from batchkv.cache import BatchedSequenceCache, CacheConfig
from batchkv.errors import ConfigError

transformers = pytest.importorskip("transformers")

from batchkv.models.hf import HFModel, quantize_decoder  # noqa: E402
from batchkv.models.hf_fuse import FusedProjection, ProjectionSlice, fuse_projections, fused_groups  # noqa: E402
from batchkv.models.quant import Fp8Linear  # noqa: E402
from tests.model_loop import make_cache, run_step, text_idx  # noqa: E402
from tests.test_model_coverage import ARCHS, NEW_TOKENS, PROMPTS, build, hf_greedy, served  # noqa: E402

# model_type: layers of the 2-layer models of the matrix with q|k|v fused, gate|up fused, and the gated
# SiLU MLP run as one SiLU-mul (Gemma's GELU MLP keeps transformers' forward over its fused gate|up)
FUSED = {"llama": (2, 2, 2), "qwen2": (2, 2, 2), "qwen3": (2, 2, 2), "mistral": (2, 2, 2), "gemma2": (2, 2, 0),
         "olmo2": (2, 2, 2), "gpt_oss": (2, 0, 0), "phi": (2, 0, 0), "deepseek_v3": (0, 1, 1), "phi3": (0, 0, 0),
         "gpt2": (0, 0, 0)}  # fmt: skip
SERVED = ("llama", "qwen2", "gemma2", "gpt_oss", "deepseek_v3")  # biases, soft-capping and sinks, MLA's dense MLP
PROMPT = [5, 17, 33, 101, 7, 7, 250, 3, 88, 41]


def _arch(model_type: str):
    return next(a for a in ARCHS if a.model_type == model_type and a.refusal is None)


def step_logits(hf: nn.Module) -> torch.Tensor:
    """float32 [len(PROMPT), vocab]: one packed prefill step of PROMPT through HFModel and a cache (the
    model fused or not as it is: `fuse=False`)."""
    model = HFModel(hf, fuse=False)
    cache = make_cache(model, max_seqs=1, max_write=len(PROMPT))
    return run_step(model, cache, [(cache.seq_new(), PROMPT, text_idx(0, len(PROMPT)))], len(PROMPT))


def gemm_calls(hf: nn.Module) -> dict[str, int]:
    """Calls of each fused layer during one HFModel step, summed per group attribute."""
    counts = {"fused_qkv": 0, "fused_gate_up": 0}
    hooks = []
    for _, _, attr, fused in fused_groups(hf):
        count = lambda *_, attr=attr: counts.__setitem__(attr, counts[attr] + 1)  # noqa: E731
        hooks.append(fused.layer.register_forward_hook(count))
    try:
        step_logits(hf)
    finally:
        for hook in hooks:
            hook.remove()
    return counts


@pytest.mark.parametrize("model_type", list(FUSED))
def test_fusion_applies_where_the_modules_allow_it_and_changes_no_logit(model_type):
    hf = build(_arch(model_type))
    want = step_logits(hf)
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    done = fuse_projections(hf)
    assert (done["fused_qkv"], done["fused_gate_up"], done["silu_mul"]) == FUSED[model_type]
    assert torch.equal(step_logits(hf), want)  # float32 on the CPU: the fused GEMM's columns are the same sums
    calls = gemm_calls(hf)
    assert calls == {"fused_qkv": FUSED[model_type][0], "fused_gate_up": FUSED[model_type][1]}  # one GEMM a group
    after = hf.state_dict()  # the unfused names and values
    assert set(after) == set(state) and all(torch.equal(after[k], state[k]) for k in state)
    assert fuse_projections(hf) == {"fused_qkv": 0, "fused_gate_up": 0, "silu_mul": 0}  # idempotent


CPU_TRITON = pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU model: Triton runs it only in the interpreter")


@pytest.mark.parametrize("attention", ["reference", pytest.param("triton", marks=CPU_TRITON)])
def test_fused_value_columns_reach_the_cache_as_views_not_copies_and_no_logit_changes(attention):
    hf = build(_arch("llama"))
    want = step_logits(hf)  # unfused, reference attention
    fuse_projections(hf)
    model = HFModel(hf, fuse=False)
    layouts = []

    def logits(copy: bool) -> torch.Tensor:  # one prefill step; `copy`: the cache given contiguous copies
        cfg = CacheConfig(**model.cache_spec(), max_seqs=1, capacity=128, max_write=len(PROMPT))
        cache = BatchedSequenceCache(cfg, model.device, attention=attention)
        attend = cache.update_and_attend

        def spy(layer, q, k, v, **kwargs):
            layouts.append(v.is_contiguous())
            return attend(layer, q, k, v.contiguous() if copy else v, **kwargs)

        cache.update_and_attend = spy
        return run_step(model, cache, [(cache.seq_new(), PROMPT, text_idx(0, len(PROMPT)))], len(PROMPT))

    got = logits(copy=False)
    assert layouts == [False] * hf.config.num_hidden_layers  # the fused product's value columns, where they are
    assert torch.equal(got, logits(copy=True))  # the same bits as from the copies
    if attention == "reference":
        assert torch.equal(got, want)


@pytest.mark.parametrize("model_type", SERVED)
def test_a_fused_model_served_by_the_engine_gives_transformers_greedy_tokens(model_type):
    hf = build(_arch(model_type))
    want = [hf_greedy(hf, prompt, NEW_TOKENS) for prompt in PROMPTS]
    fuse_projections(hf)
    assert served(hf) == want
    assert [hf_greedy(hf, prompt, NEW_TOKENS) for prompt in PROMPTS] == want  # transformers' own forward, fused
    assert hf.config._attn_implementation == "eager"


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "gpt_oss"])
def test_fp8_fused_equals_fp8_unfused_whichever_comes_first(model_type):
    base = build(_arch(model_type)).to(torch.bfloat16)
    unfused = copy.deepcopy(base)
    quantize_decoder(unfused)
    want = step_logits(unfused)
    quantised_then_fused = copy.deepcopy(unfused)
    fuse_projections(quantised_then_fused)
    fused_then_quantised = copy.deepcopy(base)
    fuse_projections(fused_then_quantised)
    quantize_decoder(fused_then_quantised)
    for model in (quantised_then_fused, fused_then_quantised):
        groups = fused_groups(model)
        assert groups and all(isinstance(fused.layer, Fp8Linear) for *_, fused in groups)
        # per-output-channel scales: the fused layer's codes and scales are the layers' own, concatenated
        q, want_q = model.model.layers[0].self_attn.q_proj, unfused.model.layers[0].self_attn.q_proj
        assert torch.equal(q.weight.view(torch.uint8), want_q.weight.view(torch.uint8))
        assert torch.equal(q.weight_scale, want_q.weight_scale)
        assert torch.equal(step_logits(model), want)  # the emulation: one quantisation of x is the same three
        assert gemm_calls(model)["fused_qkv"] == 2
    assert not torch.equal(want, step_logits(base))  # fp8 is in play


def test_a_slice_called_alone_or_out_of_order_gives_its_own_projection():
    torch.manual_seed(0)
    layers = [nn.Linear(8, n, bias=True) for n in (6, 4, 4)]
    fused = FusedProjection.of(layers, ("q_proj", "k_proj", "v_proj"))
    q, k, v = (ProjectionSlice(fused, i) for i in range(3))
    x, y = torch.randn(3, 8), torch.randn(3, 8)
    with torch.no_grad():
        expect = [[F.linear(t, m.weight, m.bias) for m in layers] for t in (x, y)]
        got = [v(x), k(y), q(x), k(x), k(x), v(y), q(y)]  # a new input, a repeat: each computes anew
    want = [expect[0][2], expect[1][1], expect[0][0], expect[0][1], expect[0][1], expect[1][2], expect[1][0]]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert fused._input is None or fused._input is y  # nothing of x held once its three were taken


def test_hooked_wrapped_or_mismatched_projections_stay_unfused():
    hooked = build(_arch("llama"))
    hooked.model.layers[0].self_attn.k_proj.register_forward_hook(lambda *_: None)
    hooked.model.layers[1].mlp.up_proj = nn.Sequential(hooked.model.layers[1].mlp.up_proj)  # an adapter's wrapper
    assert fuse_projections(hooked) == {"fused_qkv": 1, "fused_gate_up": 1, "silu_mul": 1}
    assert isinstance(hooked.model.layers[0].self_attn.q_proj, nn.Linear)
    mixed = build(_arch("llama"))
    quantize_decoder(mixed, keep=lambda i, name: name == "v_proj")  # q, k fp8 and v float: not one layer
    assert fuse_projections(mixed) == {"fused_qkv": 0, "fused_gate_up": 2, "silu_mul": 2}


def test_quantising_a_fused_group_in_part_is_refused():
    hf = build(_arch("llama"))
    fuse_projections(hf)
    with pytest.raises(ConfigError, match=r"gate_proj \| up_proj are fused"):
        quantize_decoder(hf, keep=lambda i, name: name == "up_proj")
    assert not any(isinstance(m, Fp8Linear) for m in hf.modules())  # refused before anything changed


def test_an_unfused_state_dict_loads_into_a_fused_model():
    source, target = build(_arch("qwen2")), build(_arch("qwen2"))
    with torch.no_grad():
        for p in target.parameters():
            p.mul_(0.5)
    fuse_projections(target)
    target.load_state_dict(source.state_dict())
    assert torch.equal(step_logits(target), step_logits(source))


def test_hfmodel_fuses_by_default_after_its_refusals_and_not_with_fuse_false():
    hf = build(_arch("llama"))
    HFModel(hf, fuse=False)
    assert isinstance(hf.model.layers[0].self_attn.q_proj, nn.Linear)
    HFModel(hf)
    assert isinstance(hf.model.layers[0].self_attn.fused_qkv, FusedProjection)
    # a cap Llama's attention would not apply: refused whatever transformers' version
    capped = dataclasses.replace(_arch("llama"), fields={"attn_logit_softcapping": 5.0})
    refused = build(capped)
    before = {name: type(m) for name, m in refused.named_modules()}
    with pytest.raises(ConfigError, match=r"attn_logit_softcapping=5\.0 is set but LlamaAttention"):
        HFModel(refused)
    assert {name: type(m) for name, m in refused.named_modules()} == before


def test_from_pretrained_fuses_unless_told_not_to(tmp_path):
    hf = build(_arch("qwen3"))
    hf.save_pretrained(tmp_path)
    fused = HFModel.from_pretrained(tmp_path, dtype=torch.float32)
    plain = HFModel.from_pretrained(tmp_path, dtype=torch.float32, fuse=False)
    assert isinstance(fused.hf.model.layers[0].self_attn.fused_qkv, FusedProjection)
    assert isinstance(plain.hf.model.layers[0].self_attn.q_proj, nn.Linear)
    assert torch.equal(step_logits(fused.hf), step_logits(plain.hf))


def test_a_fused_model_runs_on_meta_tensors_with_static_shapes():
    from tests.test_models_graph_safety import RecordingCache, _inputs, _tiny_qwen3

    hf = _tiny_qwen3().to("meta")
    assert fuse_projections(hf) == {"fused_qkv": 2, "fused_gate_up": 2, "silu_mul": 2}
    cache = RecordingCache()
    ids, idx, rows = _inputs(12, 3, 256, "meta")
    out = HFModel(hf)(ids, idx, cache, rows)
    assert (out.shape, out.device.type) == ((3, 256), "meta")
    assert [c[:4] for c in cache.calls] == [(layer, (12, 4, 16), (12, 2, 16), (12, 2, 16)) for layer in range(2)]


@pytest.mark.gpu
@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_a_fused_model_captures_in_a_cuda_graph_and_replays_what_the_unfused_model_computes(quantization):
    from tests.test_models_graph_safety import _capture_and_replay, _tiny_qwen3

    plain = _tiny_qwen3().to("cuda", torch.bfloat16)
    if quantization:
        quantize_decoder(plain)
    fused = copy.deepcopy(plain)
    fuse_projections(fused)
    replayed, eager = _capture_and_replay(HFModel(fused), width=16, rows=4)
    torch.testing.assert_close(replayed, eager)
    _, unfused = _capture_and_replay(HFModel(plain, fuse=False), width=16, rows=4)
    torch.testing.assert_close(eager, unfused, rtol=2e-2, atol=2e-2)  # bf16 GEMMs of other widths: other tilings


def test_model_step_fusion_ab_smoke_times_bf16_and_fp8_fused_and_unfused(tmp_path):
    import json
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "fusion.json"
    args = ["bench/model_step.py", "--fusion-ab", "--fusion-small", "--device", "cpu", "--iters", "1", "--rows", "1",
            "4", "--json", str(out)]  # fmt: skip
    proc = subprocess.run([sys.executable, *args], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {row["rows"]: row for row in json.loads(out.read_text())["fusion_ab"]}
    assert set(rows) == {1, 4}
    for row in rows.values():
        for key in ("bf16_unfused", "bf16_fused", "bf16_layers", "fp8_unfused", "fp8_fused", "fp8_layers"):
            assert row[f"{key}_ms"] > 0 and row[f"{key}_timed"] == "wall"
        assert row["fp8_layers_noquant_ms"] > 0
