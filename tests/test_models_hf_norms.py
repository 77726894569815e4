"""transformers' RMSNorm modules swapped for one kernel (batchkv.models.hf_norms), against the modules themselves."""

from __future__ import annotations

import copy
import functools
import math

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from tests.model_loop import greedy_through_cache

transformers = pytest.importorskip("transformers")
pytest.importorskip("triton")

from transformers.models.gemma.modeling_gemma import GemmaRMSNorm  # noqa: E402
from transformers.models.gemma3n.modeling_gemma3n import Gemma3nRMSNorm  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaRMSNorm  # noqa: E402
from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm  # noqa: E402
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm  # noqa: E402

from batchkv.models import fused, hf_norms, hf_rope  # noqa: E402
from batchkv.models.hf import HFModel  # noqa: E402
from batchkv.models.hf_norms import FusedRMSNorm, fuse_norms, norm_form  # noqa: E402
from batchkv.models.hf_rope import fuse_rope  # noqa: E402

GEOMETRY = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
}
PROMPTS = [[5, 17, 33], [101, 7, 7, 250, 3, 88, 41], [9, 200, 150, 4]]
MAX_NEW = [6, 4, 7]


def _norm(cls, n: int, dtype: torch.dtype, seed: int, weight_dtype: torch.dtype | None = None) -> nn.Module:
    module = cls(n, eps=1e-5)
    with torch.no_grad():
        module.weight.copy_(torch.randn(n, generator=torch.Generator().manual_seed(seed)))
    return module.to(weight_dtype or dtype)


def _poisoned(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """x of `shape` inside a buffer whose rows before and after are NaN (a read past x shows)."""
    n = shape[-1]
    rows = math.prod(shape[:-1])
    buf = torch.full((rows + 2, n), float("nan"), dtype=dtype)
    buf[1:-1] = (torch.randn(rows, n, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)
    return buf[1:-1].view(shape)


FORMS = [  # class, x dtype, weight dtype (float32 weights with bf16 rows: Llama's product is float32)
    (LlamaRMSNorm, torch.float32, None),
    (LlamaRMSNorm, torch.bfloat16, None),
    (LlamaRMSNorm, torch.bfloat16, torch.float32),
    (Qwen3RMSNorm, torch.bfloat16, None),
    (GemmaRMSNorm, torch.bfloat16, None),
    (GemmaRMSNorm, torch.float32, None),
    (Olmo2RMSNorm, torch.bfloat16, None),
]


@pytest.mark.parametrize(("cls", "dtype", "weight_dtype"), FORMS)
@pytest.mark.parametrize("shape", [(1, 5, 96), (1, 3, 5, 32)])  # hidden rows; per-head rows, many to a program
def test_the_kernel_gives_the_transformers_modules_output(cls, dtype, weight_dtype, shape):
    module = _norm(cls, shape[-1], dtype, seed=shape[-1], weight_dtype=weight_dtype)
    x = _poisoned(shape, dtype, seed=len(shape))
    form = norm_form(module)
    with torch.no_grad():
        want = module(x)
        got = fused.rms_norm(x, module.weight, 1e-5, offset=form.offset, round_first=form.round_first,
                             triton_kernel=True)  # fmt: skip
    assert got.shape == want.shape and got.dtype == want.dtype
    assert not got.isnan().any()
    if dtype == torch.bfloat16:  # the kernel's sum and 1/sqrt against torch's mean and rsqrt: a bf16 ulp
        torch.testing.assert_close(got, want, rtol=2**-7, atol=2**-7 * want.abs().max().item())
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_kernel_reads_a_strided_input_by_its_strides():
    module = _norm(LlamaRMSNorm, 32, torch.float32, seed=3)
    x = torch.randn(32, 6).t()[None]  # [1, 6, 32] with a column stride of 6
    with torch.no_grad():
        got = fused.rms_norm(x, module.weight, 1e-5, triton_kernel=True)
        torch.testing.assert_close(got, module(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("cls", "dtype", "weight_dtype"), FORMS)
def test_off_cuda_the_swapped_module_is_the_transformers_module_to_the_bit(cls, dtype, weight_dtype):
    module = _norm(cls, 48, dtype, seed=7, weight_dtype=weight_dtype)
    holder = nn.Sequential(module)
    assert fuse_norms(holder) == 1
    assert isinstance(holder[0], FusedRMSNorm) and holder[0].weight is module.weight
    x = _poisoned((2, 3, 48), dtype, seed=1)
    with torch.no_grad():
        assert torch.equal(holder[0](x), module(x))
    x.requires_grad_(True)  # autograd records: the torch path, with gradients
    holder[0](x).sum().backward()
    assert x.grad is not None and module.weight.grad is not None


class _RenamedLlama(nn.Module):
    """Llama's computation in other words: local names, annotations, a docstring."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.variance_epsilon = 1e-6

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        """Normalise."""
        dt = rows.dtype
        rows = rows.to(torch.float32)
        var = rows.pow(2).mean(-1, keepdim=True)
        rows = rows * torch.rsqrt(var + self.variance_epsilon)  # scaled
        return self.weight * rows.to(dt)


class _MeanOverHeads(_RenamedLlama):
    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        dt = rows.dtype
        rows = rows.to(torch.float32)
        var = rows.pow(2).mean(-2, keepdim=True)
        rows = rows * torch.rsqrt(var + self.variance_epsilon)
        return self.weight * rows.to(dt)


class _OffsetLlama(_RenamedLlama):
    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        dt = rows.dtype
        rows = rows.to(torch.float32)
        var = rows.pow(2).mean(-1, keepdim=True)
        rows = rows * torch.rsqrt(var + self.variance_epsilon)
        return (1 + self.weight) * rows.to(dt)


class _CalledDifferently(_RenamedLlama):
    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        return super().__call__(rows) * 2


def test_the_rule_takes_llamas_computation_in_other_words_and_nothing_else():
    assert norm_form(_RenamedLlama(8)) == hf_norms.NormForm("variance_epsilon", 0.0, True)
    assert norm_form(_MeanOverHeads(8)) is None
    assert norm_form(_OffsetLlama(8)) is None
    assert norm_form(_CalledDifferently(8)) is None
    assert norm_form(Gemma3nRMSNorm(8)) is None  # its weight is optional (with_scale)
    assert norm_form(GemmaRMSNorm(8)) == hf_norms.NormForm("eps", 1.0, False)
    assert norm_form(Olmo2RMSNorm(8)) == hf_norms.NormForm("variance_epsilon", 0.0, False)
    scope = {"nn": nn, "torch": torch}  # a class without source: not known
    exec("class Built(nn.Module):\n    def forward(self, x):\n        return x\n", scope)
    assert norm_form(scope["Built"]()) is None


def test_the_rule_leaves_a_module_with_a_hook_a_buffer_or_another_parameter():
    hooked = LlamaRMSNorm(8)
    hooked.register_forward_hook(lambda m, a, o: o)
    buffered = LlamaRMSNorm(8)
    buffered.register_buffer("extra", torch.zeros(1))
    biased = LlamaRMSNorm(8)
    biased.bias = nn.Parameter(torch.zeros(8))
    for module in (hooked, buffered, biased):
        assert norm_form(module) is None
        assert fuse_norms(nn.Sequential(module)) == 0


def _peaky(model: nn.Module, seed: int) -> nn.Module:
    """Weights with clear greedy winners (norm weights away from 1, so a lost weight shows)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
            else:
                std = 8.0 / math.sqrt(p.shape[1]) if "lm_head" in name else 1.0 / math.sqrt(p.shape[1])
                p.copy_(torch.randn(p.shape, generator=gen) * (1.0 if "embed" in name else std))
    return model.eval()


MODELS = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**GEOMETRY)),
    "qwen3": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**GEOMETRY)),
    "gemma": lambda: transformers.GemmaForCausalLM(transformers.GemmaConfig(**GEOMETRY)),
}
NORMS_PER_LAYER = {"llama": 2, "qwen3": 4, "gemma": 2}  # Qwen3: q_norm and k_norm too


def _hf_greedy(hf: nn.Module, prompt: list[int], n: int) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
                      max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)  # fmt: skip
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_greedy_tokens_with_the_kernel_norms_equal_transformers_generate(name, monkeypatch):
    hf = _peaky(MODELS[name](), seed=len(name))
    want = [_hf_greedy(hf, prompt, n) for prompt, n in zip(PROMPTS, MAX_NEW, strict=True)]
    keys = set(hf.state_dict())
    model = HFModel(hf)
    fused_modules = [m for m in hf.modules() if isinstance(m, FusedRMSNorm)]
    assert len(fused_modules) == NORMS_PER_LAYER[name] * GEOMETRY["num_hidden_layers"] + 1
    assert set(hf.state_dict()) == keys
    monkeypatch.setattr(hf_norms, "rms_norm", functools.partial(fused.rms_norm, triton_kernel=True))
    assert greedy_through_cache(model, PROMPTS, MAX_NEW, max_write=4, bucket=4) == want


def test_with_fuse_off_hfmodel_leaves_the_norms_alone(monkeypatch):
    monkeypatch.setattr(hf_norms, "FUSE", False)
    hf = MODELS["llama"]()
    HFModel(hf)
    assert not any(isinstance(m, FusedRMSNorm) for m in hf.modules())


class _Kernels(TorchDispatchMode):
    """Counts what would launch on a GPU: ATen ops that compute (not views, allocations or metadata)
    and the norm kernel's launches (the interpreter's own ops inside one not counted)."""

    QUIET = ("empty", "empty_like", "new_empty", "set_", "promote_types", "view", "_unsafe_view", "alias")

    def __init__(self) -> None:
        super().__init__()
        self.count, self.on, self.inside = 0, False, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if self.on and not self.inside and not func.is_view and name not in self.QUIET:
            self.count += 1
        return func(*args, **(kwargs or {}))


class _CountedLaunch:
    def __init__(self, kernel, mode: _Kernels) -> None:
        self.kernel, self.mode = kernel, mode

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.mode.count += self.mode.on
            self.mode.inside = True
            try:
                return self.kernel[grid](*args, **kwargs)
            finally:
                self.mode.inside = False

        return launch


def _kernels_of_layer_zero(hf: nn.Module, monkeypatch) -> int:
    mode = _Kernels()
    for kernel in ("_rms_norm_kernel", "_rope_qk_kernel"):
        monkeypatch.setattr(fused, kernel, _CountedLaunch(getattr(fused, kernel), mode))
    layer = hf.model.layers[0]
    layer.register_forward_pre_hook(lambda m, a: setattr(mode, "on", True))
    layer.register_forward_hook(lambda m, a, o: setattr(mode, "on", False))
    with torch.no_grad(), mode:
        hf(input_ids=torch.tensor([[3, 4, 5]]), use_cache=False)
    return mode.count


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_a_decoder_layer_launches_seven_fewer_kernels_per_norm_and_nine_fewer_for_the_rope(name, monkeypatch):
    hf = MODELS[name]().to(torch.bfloat16).eval()  # bf16, as served: both casts are kernels
    before = _kernels_of_layer_zero(copy.deepcopy(hf), monkeypatch)
    fuse_norms(hf)
    rope = fuse_rope(hf)
    assert rope == GEOMETRY["num_hidden_layers"]
    monkeypatch.setattr(hf_norms, "rms_norm", functools.partial(fused.rms_norm, triton_kernel=True))
    monkeypatch.setattr(hf_rope, "rope_qk", functools.partial(fused.rope_qk, triton_kernel=True))
    after = _kernels_of_layer_zero(hf, monkeypatch)
    assert before - after == 7 * NORMS_PER_LAYER[name] + 9, (before, after)
