"""FP8 checkpoints as their publishers ship them: a transformers directory whose config.json has a
`quantization_config`, in one of two formats.

- transformers' `fp8` (`FineGrainedFP8Config`; Qwen3's and DeepSeek's FP8 releases): each quantised
  projection holds `<name>.weight` (F8_E4M3, [N, K]) and `<name>.weight_scale_inv` (F32 or BF16,
  [ceil(N / bn), ceil(K / bk)] for `weight_block_size` [bn, bk], a scalar without blocks), with
  W = weight * weight_scale_inv on each block; `activation_scheme` "dynamic" (or "static", which
  adds an `activation_scale`); `modules_to_not_convert` names modules left in the float dtype.
- compressed-tensors, format `float-quantized` (llm-compressor's FP8 and FP8_DYNAMIC schemes): a
  config group targeting `Linear` with `weights` {num_bits 8, type float, symmetric, strategy
  "channel" or "tensor"} holds `<name>.weight` (F8_E4M3) and `<name>.weight_scale` ([N, 1] per
  channel, [1] or a scalar per tensor), W = weight * weight_scale; `input_activations` dynamic per
  token, or static per tensor with an `<name>.input_scale`; `ignore` lists module names (or
  `re:` patterns) left in the float dtype.

Per-channel and per-tensor weights are used as stored: their codes are the layer's codes, their
scales its per-channel scales (a tensor's repeated). Block-wise weights are requantised per output
channel at load (dequantised in float32, then `quantize_weight`): one GEMM layout serves every model
(row-wise scaled matmul, the few-row kernel and the emulation), at the cost of rounding the codes
twice where a row's blocks have different scales (`tests/test_quant_checkpoints.py` bounds it).
Activations are always quantised per token at run time: a static activation scale is checked and
not used (per-token scales are never coarser).

Everything is checked before anything is copied: every tensor the model needs is present with its
dtype and shape, its scales with theirs, and nothing else is in the files; a `quant_method` other
than these two is a ConfigError naming it.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from batchkv.errors import CheckpointError, ConfigError
from batchkv.models.quant.fp8 import E4M3, Fp8Linear, quantize_weight

METHODS = ("fp8", "compressed-tensors")
_PROJECTIONS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}
_FLOAT_SCALES = (torch.float32, torch.bfloat16, torch.float16)


def quantization_config(directory: str | Path) -> dict | None:
    """The `quantization_config` of a directory's config.json (None when it has none)."""
    path = Path(directory) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path} is not a readable config.json ({exc})") from exc
    found = config.get("quantization_config")
    if found is not None and not isinstance(found, dict):
        raise ConfigError(f"{path}: quantization_config is {found!r}; a checkpoint's quantization_config is an object")
    return found


@dataclass(frozen=True)
class Scheme:
    """What a quantization_config says about one checkpoint's projections."""

    method: str  # "fp8" or "compressed-tensors"
    scale_name: str  # "weight_scale_inv" or "weight_scale"
    block: tuple[int, int] | None  # fp8: weight_block_size; None: per tensor (fp8) or per channel/tensor (c-t)
    strategy: str  # "block", "tensor" or "channel"
    activation_scale: str | None  # the static activation scale's name ("activation_scale", "input_scale"), or None
    skip: tuple[str, ...]  # module names (or "re:" patterns) left in the float dtype

    def skips(self, module: str) -> bool:
        """Whether module `module` (e.g. "model.layers.0.mlp.down_proj") stays in the float dtype."""
        for pattern in self.skip:
            if pattern.startswith("re:"):
                if re.match(pattern[3:], module):
                    return True
            elif module == pattern or module.endswith("." + pattern) or module.startswith(pattern + "."):
                return True
        return False


def _bad(where: str, what: str) -> ConfigError:
    return ConfigError(f"{where}: {what}; batchkv loads FP8 checkpoints in transformers' 'fp8' or "
                       "compressed-tensors' 'float-quantized' format")  # fmt: skip


def read_scheme(qc: dict, where: str = "quantization_config") -> Scheme:
    """The `Scheme` of a quantization_config; ConfigError for anything these loaders do not read."""
    method = qc.get("quant_method")
    if method == "fp8":
        block = qc.get("weight_block_size")
        if block is not None and (len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block)):
            raise _bad(where, f"weight_block_size is {block!r}; expected two positive ints or null")
        if qc.get("scale_fmt", "float") != "float":
            raise _bad(where, f"scale_fmt {qc.get('scale_fmt')!r} (power-of-two ue8m0 scales) is not read")
        scheme = qc.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise _bad(where, f"activation_scheme is {scheme!r}; expected 'dynamic' or 'static'")
        if qc.get("fmt", "e4m3") != "e4m3":
            raise _bad(where, f"fmt is {qc.get('fmt')!r}; only e4m3 weights are read")
        return Scheme("fp8", "weight_scale_inv", tuple(block) if block else None, "block" if block else "tensor",
                      "activation_scale" if scheme == "static" else None,
                      tuple(qc.get("modules_to_not_convert") or ()))  # fmt: skip
    if method == "compressed-tensors":
        if qc.get("format") not in ("float-quantized", None):
            raise _bad(where, f"compressed-tensors format {qc.get('format')!r} is not read; only 'float-quantized'")
        groups = qc.get("config_groups") or {}
        if len(groups) != 1:
            raise _bad(where, f"{len(groups)} config_groups; one group of Linear layers is read")
        group = next(iter(groups.values()))
        targets, weights, inputs = group.get("targets"), group.get("weights") or {}, group.get("input_activations")
        if targets != ["Linear"]:
            raise _bad(where, f"config group targets {targets!r}; expected ['Linear']")
        want = {"num_bits": 8, "type": "float", "symmetric": True}
        if any(weights.get(k) != v for k, v in want.items()) or weights.get("strategy") not in ("channel", "tensor"):
            raise _bad(where, f"weights {weights!r}; expected 8-bit float, symmetric, strategy channel or tensor")
        if weights.get("dynamic"):
            raise _bad(where, "dynamic weight scales; a checkpoint's weights carry their scales")
        static = None
        if inputs is not None:
            if inputs.get("num_bits") != 8 or inputs.get("type") != "float":
                raise _bad(where, f"input_activations {inputs!r}; expected 8-bit float")
            if inputs.get("dynamic") is True and inputs.get("strategy") == "token":
                static = None
            elif inputs.get("dynamic") is False and inputs.get("strategy") == "tensor":
                static = "input_scale"
            else:
                raise _bad(where, f"input_activations {inputs!r}; expected dynamic per token or static per tensor")
        return Scheme("compressed-tensors", "weight_scale", None, weights["strategy"], static,
                      tuple(qc.get("ignore") or ()))  # fmt: skip
    raise ConfigError(f"{where}: quant_method {method!r} is not read by batchkv; it loads {METHODS} FP8 checkpoints "
                      "(or give a float checkpoint and quantization='fp8')")  # fmt: skip


def _scale_shape(scheme: Scheme, n: int, k: int) -> tuple[tuple[int, ...], ...]:
    if scheme.strategy == "block":
        bn, bk = scheme.block  # type: ignore[misc]
        return ((math.ceil(n / bn), math.ceil(k / bk)),)
    if scheme.strategy == "channel":
        return ((n, 1), (n,))
    return ((), (1,))


def per_channel(codes: torch.Tensor, scale: torch.Tensor, scheme: Scheme) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's (codes [N, K], per-channel scales [N]) of a checkpoint's weight and scale."""
    n, k = codes.shape
    scale = scale.float()
    if scheme.strategy == "channel":
        return codes, scale.reshape(n)
    if scheme.strategy == "tensor":
        return codes, scale.reshape(1).expand(n).contiguous()
    bn, bk = scheme.block  # type: ignore[misc]
    full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return quantize_weight(codes.float() * full)


def _quantized_modules(hf: nn.Module, scheme: Scheme) -> dict[str, nn.Linear]:
    decoder_prefix = hf.base_model_prefix
    found = {}
    for i, layer in enumerate(getattr(hf, decoder_prefix).layers):
        for part, names in _PROJECTIONS.items():
            for name in names:
                module = getattr(getattr(layer, part, None), name, None)
                where = f"{decoder_prefix}.layers.{i}.{part}.{name}"
                if isinstance(module, nn.Linear) and not scheme.skips(where):
                    found[where] = module
    return found


def load_quantized_hf(directory: str | Path, *, device: torch.device, dtype: torch.dtype | None = None) -> nn.Module:
    """A transformers causal LM of an FP8 checkpoint directory (see the module docstring), on `device`:
    its quantised projections `Fp8Linear`s, everything else in `dtype` (None: the config's)."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from batchkv.models.parallel.slices import SafetensorsSlices

    directory = Path(directory)
    scheme = read_scheme(quantization_config(directory) or {}, f"{directory}/config.json quantization_config")
    config = AutoConfig.from_pretrained(str(directory))
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # transformers' own quantizer must not run: the layers are ours
    dtype = dtype or getattr(config, "dtype", None) or torch.bfloat16
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config, dtype=dtype)
        layers = _quantized_modules(hf, scheme)
        for where, module in layers.items():
            parent, name = where.rsplit(".", 1)
            meta_codes = torch.empty(module.out_features, module.in_features, dtype=E4M3)
            bias = None if module.bias is None else torch.empty(module.out_features, dtype=dtype)
            layer = Fp8Linear(meta_codes, torch.empty(module.out_features), bias, dtype=dtype)
            setattr(hf.get_submodule(parent), name, layer)
    tied = getattr(config, "tie_word_embeddings", False)
    with SafetensorsSlices(directory) as ckpt:
        plan = _plan(hf, layers, scheme, ckpt, tied, directory)  # every check before any copy
        hf.to_empty(device=device)
        decoder = getattr(hf, hf.base_model_prefix)
        if tied:
            hf.lm_head.weight = decoder.embed_tokens.weight
        decoder.rotary_emb = type(decoder.rotary_emb)(config).to(device)  # its tables, which meta left empty
        with torch.no_grad():
            for target, source in plan:
                if isinstance(source, tuple):  # a quantised projection: (weight name, scale name)
                    layer = hf.get_submodule(target)
                    codes, scale = per_channel(ckpt.read(source[0]), ckpt.read(source[1]), scheme)
                    layer.weight.copy_(codes)
                    layer.weight_scale.copy_(scale)
                else:
                    _tensor(hf, target).copy_(ckpt.read(source))
    if (directory / "generation_config.json").is_file():
        hf.generation_config = GenerationConfig.from_pretrained(str(directory))
    return hf.eval()


def _tensor(hf: nn.Module, name: str) -> torch.Tensor:
    parent, attr = name.rsplit(".", 1)
    return getattr(hf.get_submodule(parent), attr)


def _plan(hf: nn.Module, layers: dict, scheme: Scheme, ckpt, tied: bool, directory: Path) -> list:
    """(target, source) pairs for every tensor to fill; CheckpointError listing every mismatch."""
    problems, plan, used = [], [], set()

    def expect(name: str, dtypes: tuple[torch.dtype, ...], shapes: tuple[tuple[int, ...], ...]) -> None:
        used.add(name)
        if name not in ckpt:
            problems.append(f"missing {name}")
            return
        _, dt, shape, _ = ckpt.entries[name]
        if dt not in dtypes or tuple(shape) not in shapes:
            problems.append(f"{name} is {dt} {list(shape)}, expected {' or '.join(map(str, dtypes))} "
                            f"{' or '.join(str(list(s)) for s in shapes)}")  # fmt: skip

    floats = (torch.bfloat16, torch.float16, torch.float32)
    for where, module in layers.items():
        n, k = module.out_features, module.in_features
        expect(f"{where}.weight", (E4M3,), ((n, k),))
        expect(f"{where}.{scheme.scale_name}", _FLOAT_SCALES, _scale_shape(scheme, n, k))
        if scheme.activation_scale is not None:
            expect(f"{where}.{scheme.activation_scale}", _FLOAT_SCALES, ((), (1,)))
        if module.bias is not None:
            expect(f"{where}.bias", floats, ((n,),))
            plan.append((f"{where}.bias", f"{where}.bias"))
        plan.append((where, (f"{where}.weight", f"{where}.{scheme.scale_name}")))
    quantised = {f"{where}.{p}" for where in layers for p in ("weight", "bias")}
    for name, param in list(hf.named_parameters()) + list(hf.named_buffers()):
        if name in quantised or name.endswith("weight_scale") or "rotary_emb" in name:
            continue
        if tied and name == "lm_head.weight":
            continue
        expect(name, floats, (tuple(param.shape),))
        plan.append((name, name))
    unexpected = sorted(set(ckpt.entries) - used)
    if unexpected:
        problems.append(f"unexpected {', '.join(unexpected[:8])}" + (" ..." if len(unexpected) > 8 else ""))
    if problems:
        more = f"; and {len(problems) - 12} more" if len(problems) > 12 else ""
        raise CheckpointError(f"{directory} does not match its config ({scheme.method} FP8): "
                              + "; ".join(problems[:12]) + more)  # fmt: skip
    return plan
