"""Which transformers decoders HFModel serves: one table, one test per architecture, the README from it.

Every architecture is a tiny random model (2 layers, GQA where the config has it, float32, peaky
weights so greedy decoding has clear winners). "match": the Engine serving three prompts together
gives, token for token, what transformers' own greedy `generate` gives each prompt alone (eager
attention, 12 new tokens), with q/k/v and gate/up fused where `HFModel` fuses them by default
(`batchkv.models.hf_fuse`; `tests/test_models_hf_fuse.py` has which). A refusal: `HFModel(model)`
raises exactly that error type, its message matching the pattern, before anything runs. The
README's list of served and refused architectures is rendered from the same table
(`readme_section`; `python -m tests.test_model_coverage` prints it).
"""

from __future__ import annotations

import inspect
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from batchkv.errors import ConfigError

transformers = pytest.importorskip("transformers")

BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, pad_token_id=0)  # fmt: skip
MHA = {k: v for k, v in BASE.items() if k not in ("num_key_value_heads", "head_dim")}  # configs without GQA fields
MOE = dict(num_experts_per_tok=2)


@dataclass(frozen=True)
class Arch:
    """One row: the name shown, transformers' model_type, config fields over `base`, and the
    expected outcome (None: tokens match; else (error type, message pattern, reason shown))."""

    name: str
    model_type: str
    fields: dict = field(default_factory=dict)
    refusal: tuple[type, str, str] | None = None
    base: dict = field(default_factory=lambda: BASE)
    until_routed: bool = False  # the refusal holds only while transformers' attention class does not dispatch


ARCHS = [
    Arch("Llama", "llama"),
    Arch("Mistral (sliding window 8)", "mistral", dict(sliding_window=8)),
    Arch("Qwen2", "qwen2"),
    Arch("Qwen3", "qwen3"),
    Arch("Qwen3-MoE", "qwen3_moe", dict(MOE, num_experts=4, moe_intermediate_size=32)),
    Arch("Mixtral", "mixtral", dict(MOE, num_local_experts=4)),
    Arch("Gemma", "gemma"),
    Arch("Gemma2 (soft-capping, sliding window 8)", "gemma2",
         dict(attn_logit_softcapping=5.0, final_logit_softcapping=8.0, sliding_window=8, query_pre_attn_scalar=16)),
    Arch("Gemma3 (text)", "gemma3_text", dict(sliding_window=8, query_pre_attn_scalar=16)),
    Arch("Phi3", "phi3"),
    Arch("Phi", "phi", dict(partial_rotary_factor=0.5)),
    Arch("OLMo2", "olmo2"),
    Arch("GPT-NeoX", "gpt_neox", dict(rotary_pct=0.5), base=MHA),
    Arch("Granite", "granite", dict(logits_scaling=4.0)),
    Arch("Cohere", "cohere"),
    Arch("Starcoder2", "starcoder2"),
    Arch("GPT-2", "gpt2", base=dict(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=256, pad_token_id=0)),
    Arch("SmolLM3", "smollm3"),
    Arch("GLM-4", "glm4"),
    Arch("EXAONE-4", "exaone4", dict(sliding_window=8)),
    Arch("ERNIE-4.5", "ernie4_5"),
    Arch("gpt-oss (attention sinks, sliding window 8)", "gpt_oss", dict(MOE, num_local_experts=4, sliding_window=8)),
    Arch("StableLM", "stablelm"),
    Arch("Falcon", "falcon", dict(new_decoder_architecture=False, multi_query=True), base=MHA, until_routed=True,
         refusal=(ConfigError, r"FalconForCausalLM \(falcon\): FalconAttention does not dispatch through "
                               r"transformers' AttentionInterface",
                  "its attention does not dispatch through transformers' AttentionInterface (it picks its own "
                  "kernel and would attend within the step only)")),
    Arch("Falcon (new decoder architecture)", "falcon", dict(new_decoder_architecture=True, num_kv_heads=2), base=MHA,
         until_routed=True, refusal=(ConfigError, r"FalconForCausalLM \(falcon\): FalconAttention does not dispatch",
                                     "as Falcon")),
    Arch("DeepSeek-V3 (multi-head latent attention: keys and values stored at their own widths)", "deepseek_v3",
         dict(MOE, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=32, qk_rope_head_dim=16,
              v_head_dim=32, n_routed_experts=4, moe_intermediate_size=32, first_k_dense_replace=1, n_group=1,
              topk_group=1),
         base=MHA),  # head_dim is the rope part (qk_rope_head_dim); K (48) and V (32) are expanded to every query head
]  # fmt: skip
PROMPTS = [[5, 17, 33], [101, 7, 7, 250, 3, 88, 41, 19, 2, 64, 77], [9, 200, 150, 4, 61, 12]]
NEW_TOKENS = 12


@torch.no_grad()
def _peaky(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Re-draw weights so greedy decoding has clear winners (the default init gives near-ties):
    vectors near 1 (norms, biases), sinks spread over +-2, matrices with unit-variance outputs, the
    output head 8x larger."""
    gen = torch.Generator().manual_seed(seed)
    head = model.get_output_embeddings().weight
    for name, p in model.named_parameters():
        if name.endswith("sinks"):
            std, mean = 2.0, 0.0
        elif p.dim() == 1:
            std, mean = 0.2, 1.0
        elif p is head:
            std, mean = 8.0 / math.sqrt(p.shape[-1]), 0.0
        elif any(word in name for word in ("embed", "wte", "wpe")):
            std, mean = 1.0, 0.0
        else:
            std, mean = 1.0 / math.sqrt(p.shape[-1]), 0.0
        p.copy_(mean + std * torch.randn(p.shape, generator=gen))
    return model.eval()


def build(arch: Arch) -> torch.nn.Module:
    """The tiny random float32 model of a row, eager attention."""
    config = transformers.AutoConfig.for_model(arch.model_type, **arch.base, **arch.fields)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # 12 tokens whatever they are (EOS is one of 256 ids)
    return _peaky(model, seed=1)


def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of n tokens, EOS an ordinary token (as the Engine's ignore_eos:
    `min_new_tokens` would mask the EOS logit instead, which the Engine does not do)."""
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
                         max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None)  # fmt: skip
    return out[0, len(prompt) :].tolist()


def routed(model: torch.nn.Module) -> bool:
    """Whether every attention class of `model` names transformers' `ALL_ATTENTION_FUNCTIONS` in its forward (read
    from transformers' source: Falcon's does from transformers 5.25 on, where 5.17's picked its kernel itself)."""
    classes = {type(m) for m in model.modules() if type(m).__name__.endswith("Attention")}
    return bool(classes) and all("ALL_ATTENTION_FUNCTIONS" in inspect.getsource(c.forward) for c in classes)


def served(model: torch.nn.Module) -> list[list[int]]:
    """The three prompts served together by one Engine (chunked prefill beside decode)."""
    from batchkv.executor import Engine, Request, SamplingParams
    from batchkv.models.hf import HFModel

    engine = Engine(HFModel(model), max_seqs=4, capacity=64, max_step_tokens=16, prefill_chunk=8)
    try:
        params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
        ids = [engine.submit(Request(prompt, params)) for prompt in PROMPTS]
        tokens: dict[int, list[int]] = {i: [] for i in ids}
        for event in engine.run_until_done():
            tokens[event.request_id].append(event.token)
        return [tokens[i] for i in ids]
    finally:
        engine.close()


@pytest.mark.parametrize(
    "arch", [pytest.param(a, id=a.model_type + ("-" + re.sub(r"\W+", "-", a.name) if "(" in a.name else ""))
             for a in ARCHS],
)  # fmt: skip
def test_each_architecture_is_served_token_for_token_or_refused_with_its_typed_error(arch):
    model = build(arch)
    if arch.refusal is not None and not (arch.until_routed and routed(model)):
        from batchkv.models.hf import HFModel

        error, pattern, _ = arch.refusal
        with pytest.raises(error, match=pattern):
            HFModel(model)
        return
    want = [hf_greedy(model, prompt, NEW_TOKENS) for prompt in PROMPTS]
    assert served(model) == want
    assert model.config._attn_implementation == "eager"  # the adapter put it back


def readme_section() -> str:
    """The README's list of architectures, from ARCHS."""
    lines = ["Served (tiny random models match transformers' greedy `generate` token for token, "
             "`tests/test_model_coverage.py`):", ""]  # fmt: skip
    lines += [f"- {a.name}" for a in ARCHS if a.refusal is None]
    lines += ["", "Served where transformers' attention class dispatches through its AttentionInterface "
              "(transformers 5.25's does), else refused at construction with a `ConfigError` naming the "
              "architecture (5.17's picks its own kernel and would attend within the step only):", ""]  # fmt: skip
    lines += [f"- {a.name}" for a in ARCHS if a.refusal is not None and a.until_routed]
    refused = [f"- {a.name}: {a.refusal[2]}" for a in ARCHS if a.refusal is not None and not a.until_routed]
    if refused:
        lines += ["", "Refused at construction with a `ConfigError` naming the architecture:", "", *refused]
    return "\n".join(lines)


BEGIN, END = "<!-- coverage: begin (tests/test_model_coverage.py) -->", "<!-- coverage: end -->"


def test_the_readme_lists_the_architectures_of_the_table():
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert BEGIN in text and END in text, "README.md lacks the coverage markers; paste readme_section() between them"
    listed = text.split(BEGIN, 1)[1].split(END, 1)[0].strip()
    assert listed == readme_section()


if __name__ == "__main__":
    print(f"{BEGIN}\n{readme_section()}\n{END}")
