"""SenseNova-U1 weights: checkpoint names, seeded random init, safetensors load and save.

Checkpoint key names mirror the usual HF/Qwen naming, with the split QK-norm of the published
model (`q_norm` scales the t half of head_dim, `q_norm_hw` the h|w half):

    model.embed_tokens.weight                         [vocab, H]
    model.layers.{i}.input_layernorm.weight           [H]
    model.layers.{i}.self_attn.q_proj.weight          [Hq * D, H]
    model.layers.{i}.self_attn.k_proj.weight          [Hkv * D, H]
    model.layers.{i}.self_attn.v_proj.weight          [Hkv * D, H]
    model.layers.{i}.self_attn.q_norm.weight          [D / 2]
    model.layers.{i}.self_attn.q_norm_hw.weight       [D / 2]
    model.layers.{i}.self_attn.k_norm.weight          [D / 2]
    model.layers.{i}.self_attn.k_norm_hw.weight       [D / 2]
    model.layers.{i}.self_attn.o_proj.weight          [H, Hq * D]
    model.layers.{i}.post_attention_layernorm.weight  [H]
    model.layers.{i}.mlp.gate_proj.weight             [I, H]
    model.layers.{i}.mlp.up_proj.weight               [I, H]
    model.layers.{i}.mlp.down_proj.weight             [H, I]
    model.norm.weight                                 [H]
    lm_head.weight                                    [vocab, H]

On load, q/k/v and gate/up are concatenated into the model's fused matrices (and the two norm
halves stacked); `save_checkpoint` splits them back. A checkpoint that nests these names (the
published one keeps the language model under a prefix and also holds generation-branch
`*_mot_gen` tensors) loads with `prefix=` and `skip=`.

A tensor-parallel shard (`SenseNovaLM(..., shard=...)`) holds a slice of most of these tensors
(`shard_span`): rows of q/k/v, gate/up, the embedding and the LM head, columns of o and down.
Random init draws each whole tensor as one rank would and keeps the slice, so every world size
builds the same model; a checkpoint is read slice by slice (`batchkv.models.parallel.slices`), so a rank
reads only its share of the file.
"""

from __future__ import annotations

import contextlib
import math
import os
import zlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from batchkv.checks import device_arg, int_arg
from batchkv.errors import CheckpointError, ConfigError, DependencyError
from batchkv.models.config import SenseNovaConfig, preset_config
from batchkv.models.parallel.shard import Shard
from batchkv.models.quant import check_quantization
from batchkv.models.sensenova import SenseNovaLM

# Fused parameter of a layer -> the checkpoint names it is made of, in order.
_LAYER_PARTS = (
    ("input_layernorm", ("input_layernorm.weight",)),
    ("qkv", ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")),
    ("q_norm", ("self_attn.q_norm.weight", "self_attn.q_norm_hw.weight")),
    ("k_norm", ("self_attn.k_norm.weight", "self_attn.k_norm_hw.weight")),
    ("o_proj", ("self_attn.o_proj.weight",)),
    ("post_attention_layernorm", ("post_attention_layernorm.weight",)),
    ("gate_up", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    ("down", ("mlp.down_proj.weight",)),
)
AUTO_CPU_INIT_LIMIT = 2**30  # params; larger models draw their random init on the target device


def checkpoint_shapes(cfg: SenseNovaConfig) -> dict[str, tuple[int, ...]]:
    """Every checkpoint name of a model with this config, and its shape."""
    h, d, i, v = cfg.hidden, cfg.head_dim, cfg.intermediate, cfg.vocab
    per_layer = {
        "input_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (cfg.q_heads * d, h),
        "self_attn.k_proj.weight": (cfg.kv_heads * d, h),
        "self_attn.v_proj.weight": (cfg.kv_heads * d, h),
        "self_attn.q_norm.weight": (d // 2,),
        "self_attn.q_norm_hw.weight": (d // 2,),
        "self_attn.k_norm.weight": (d // 2,),
        "self_attn.k_norm_hw.weight": (d // 2,),
        "self_attn.o_proj.weight": (h, cfg.q_heads * d),
        "post_attention_layernorm.weight": (h,),
        "mlp.gate_proj.weight": (i, h),
        "mlp.up_proj.weight": (i, h),
        "mlp.down_proj.weight": (h, i),
    }
    shapes = {"model.embed_tokens.weight": (v, h)}
    for layer in range(cfg.num_layers):
        shapes.update({f"model.layers.{layer}.{name}": shape for name, shape in per_layer.items()})
    shapes["model.norm.weight"] = (h,)
    shapes["lm_head.weight"] = (v, h)
    return shapes


def shard_span(name: str, cfg: SenseNovaConfig, shard: Shard) -> tuple[int, range] | None:
    """(dim, range) of checkpoint tensor `name` that `shard` holds; None: the whole tensor (norms)."""
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return 0, shard.vocab(cfg.vocab)
    q, kv = (range(h.start * cfg.head_dim, h.stop * cfg.head_dim) for h in shard.heads(cfg.q_heads, cfg.kv_heads))
    inter = shard.part(cfg.intermediate, "the MLP width (intermediate)")
    spans = {"q_proj": (0, q), "k_proj": (0, kv), "v_proj": (0, kv), "o_proj": (1, q), "gate_proj": (0, inter),
             "up_proj": (0, inter), "down_proj": (1, inter)}  # fmt: skip
    return spans.get(name.rsplit(".", 2)[-2])  # q_proj, ..., or a norm's name


def _keep(whole: torch.Tensor, span: tuple[int, range] | None, target: torch.Tensor) -> torch.Tensor:
    """The part of `whole` a shard holds (span None: all of it), padded with zero rows to `target`'s
    rows (the last ranks' vocabulary padding)."""
    part = whole if span is None else whole.narrow(span[0], span[1].start, len(span[1]))
    if part.shape[0] < target.shape[0]:
        part = torch.cat([part, part.new_zeros(target.shape[0] - part.shape[0], *part.shape[1:])])
    return part


def named_weights(model: SenseNovaLM) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, view into the fused model parameter that holds it), in checkpoint order.

    The views share storage with the model: no copy, same device and dtype. A tensor-parallel
    shard's views have its shapes (`model.local_config`): see `shard_span`.
    """
    if getattr(model, "quantization", None) is not None:
        raise CheckpointError(
            f"this model's projections are {model.quantization} layers, not float weights: load, initialise or "
            "save the float model (build_model without quantization=) and quantise it after"
        )
    shapes = checkpoint_shapes(model.local_config)
    yield "model.embed_tokens.weight", model.embed_tokens.data
    for layer, p in enumerate(model.layers):
        for attr, names in _LAYER_PARTS:
            flat, offset = getattr(p, attr).data.view(-1), 0
            for name in names:
                full = f"model.layers.{layer}.{name}"
                n = math.prod(shapes[full])
                yield full, flat[offset : offset + n].view(shapes[full])
                offset += n
    yield "model.norm.weight", model.norm.data
    yield "lm_head.weight", model.lm_head.data


def _init_std(cfg: SenseNovaConfig, name: str, shape: tuple[int, ...]) -> float:
    if name == "model.embed_tokens.weight":
        return 1.0
    if name == "lm_head.weight":
        return cfg.lm_head_gain / math.sqrt(shape[1])
    return cfg.init_gain / math.sqrt(shape[1])


@torch.no_grad()
def random_init(model: SenseNovaLM, seed: int = 0, on: str = "auto") -> None:
    """Fill every parameter from `seed`. Each checkpoint tensor has its own generator seeded by
    (seed, name), so the draw does not depend on order or fusion.

    on="cpu": draw on the CPU, then move: identical on every device. on="device": draw on the
    model's device (fast for 8B; reproducible per device kind only). "auto": CPU up to
    AUTO_CPU_INIT_LIMIT parameters, else the device. Norm weights are 1 + norm_jitter * N(0, 1);
    projections N(0, gain^2 / fan_in); the embedding N(0, 1).
    """
    cfg = model.config
    seed = int_arg("random_init seed", seed)
    if on == "auto":
        on = "cpu" if cfg.num_params <= AUTO_CPU_INIT_LIMIT else "device"
    if on not in ("cpu", "device"):
        raise ConfigError(f"random_init(on={on!r}); use 'auto', 'cpu' or 'device'")
    gen_device = torch.device("cpu") if on == "cpu" else model.device
    full = checkpoint_shapes(cfg)  # a shard draws the whole tensor and keeps its slice
    for name, target in named_weights(model):
        gen = torch.Generator(device=gen_device).manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**62)
        draw = torch.randn(full[name], generator=gen, device=gen_device, dtype=torch.float32)
        if target.dim() == 1:  # a norm weight
            draw = 1.0 + cfg.norm_jitter * draw
        else:
            draw *= _init_std(cfg, name, full[name])
        target.copy_(_keep(draw, shard_span(name, cfg, model.shard), target))


def _checkpoint_files(path: str | os.PathLike) -> list[Path]:
    if not isinstance(path, (str, os.PathLike)):
        raise CheckpointError(f"checkpoint is {path!r}; give the path of a .safetensors file or a folder of them")
    path = Path(path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files or not all(f.is_file() for f in files):
        raise CheckpointError(f"no safetensors checkpoint at {path} (give a .safetensors file or a folder of them)")
    return files


def _safetensors() -> tuple[Callable[..., Any], type[Exception]]:
    """safetensors' `safe_open` and the error it raises for a bad file (a DependencyError when missing)."""
    try:
        from safetensors import SafetensorError, safe_open
    except ImportError as exc:
        raise DependencyError(f"checkpoints need safetensors ({exc}); pip install safetensors") from exc
    return safe_open, SafetensorError


def _listing(title: str, items: Sequence[str], limit: int = 8) -> str:
    more = f" ... and {len(items) - limit} more" if len(items) > limit else ""
    return f"{title} ({len(items)}): {', '.join(items[:limit])}{more}"


@torch.no_grad()
def load_checkpoint(model: SenseNovaLM, path: str | os.PathLike, *, prefix: str = "", skip: Sequence[str] = ()) -> None:
    """Load a safetensors checkpoint (a file, or a folder of shards) into `model`, fusing as it goes.

    Names are those listed in the module docstring, each preceded by `prefix`. Tensors whose name
    does not start with `prefix`, or contains any substring in `skip`, are ignored. Every name and
    shape is checked before any tensor is read: a missing, unexpected or misshapen tensor raises
    CheckpointError listing them, and the model is left unchanged. A file that is not a whole
    safetensors file (empty, truncated, another format, an absurd header) is a CheckpointError
    naming it. Tensors are cast to the model's dtype.
    """
    if not isinstance(prefix, str) or isinstance(skip, str) or not all(isinstance(s, str) for s in skip):
        raise CheckpointError(f"prefix must be a str and skip a sequence of str; got {prefix!r}, {skip!r}")
    safe_open, unreadable = _safetensors()
    expected = checkpoint_shapes(model.config)
    with contextlib.ExitStack() as stack:
        where: dict[str, object] = {}
        found: dict[str, tuple[int, ...]] = {}
        for file in _checkpoint_files(path):
            try:
                handle = stack.enter_context(safe_open(str(file), framework="pt", device=str(model.device)))
                keys = list(handle.keys())
            except (unreadable, OSError) as exc:
                raise CheckpointError(f"{file} is not a readable safetensors file: {exc}") from exc
            for key in keys:
                if not key.startswith(prefix) or any(s in key for s in skip):
                    continue
                name = key[len(prefix) :]
                where[name] = handle
                found[name] = tuple(handle.get_slice(key).get_shape())
        missing = [n for n in expected if n not in found]
        unexpected = sorted(n for n in found if n not in expected)
        misshapen = [f"{n} {found[n]} != {expected[n]}" for n in expected if n in found and found[n] != expected[n]]
        if missing or unexpected or misshapen:
            problems = [
                _listing(title, items)
                for title, items in (("missing", missing), ("unexpected", unexpected), ("misshapen", misshapen))
                if items
            ]
            raise CheckpointError(
                f"checkpoint {path} does not match the model (prefix={prefix!r}): "
                + "; ".join(problems)
                + ". Check the preset, the prefix and skip= for tensors of other model parts"
            )
        if model.shard.world > 1:
            stack.close()  # a shard reads its slices only (models.parallel.slices), not through the mapped files
            _load_shard(model, path, prefix)
            return
        for name, target in named_weights(model):
            target.copy_(where[name].get_tensor(prefix + name))


def _load_shard(model: SenseNovaLM, path: str | os.PathLike, prefix: str) -> None:
    from batchkv.models.parallel.slices import SafetensorsSlices

    with SafetensorsSlices(path) as ckpt:
        for name, target in named_weights(model):
            span = shard_span(name, model.config, model.shard)
            target.copy_(_keep(ckpt.read(prefix + name, *(span or (None, None))), None, target))


def checkpoint_tensors(model: SenseNovaLM) -> dict[str, torch.Tensor]:
    """The model's weights under their checkpoint names, as independent CPU tensors."""
    return {name: view.detach().to("cpu", copy=True).contiguous() for name, view in named_weights(model)}


def save_checkpoint(model: SenseNovaLM, path: str | os.PathLike) -> None:
    """Write `model`'s weights to one safetensors file under the checkpoint names (q/k/v and gate/up split)."""
    from safetensors.torch import save_file

    save_file(checkpoint_tensors(model), str(path), metadata={"format": "pt", "model": "sensenova-u1"})


def build_model(
    preset: str | SenseNovaConfig,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    seed: int = 0,
    checkpoint: str | os.PathLike | None = None,
    *,
    init_on: str = "auto",
    prefix: str = "",
    skip: Sequence[str] = (),
    shard: Shard | None = None,
    quantization: str | None = None,
) -> SenseNovaLM:
    """A SenseNova-U1 language model from a preset name (see MODEL_PRESETS) or a config.

    Weights come from `checkpoint` (see `load_checkpoint`; `prefix`/`skip` pass through) or, when
    it is None, from a random init seeded by `seed` (see `random_init`; `init_on`). `dtype`
    defaults to the preset's. `shard`: one tensor-parallel rank's share (`batchkv.models.parallel.Shard`).
    `quantization="fp8"`: the decoder's projections become `batchkv.models.quant.Fp8Linear`s
    (e4m3 weights with per-output-channel scales computed from the loaded weights; a shard's from
    its slices); the embedding and the LM head stay in `dtype`.

    >>> model = build_model("sensenova-u1-tiny", "cpu", seed=0)
    """
    if not isinstance(preset, (str, SenseNovaConfig)):
        raise ConfigError(f"build_model preset is {preset!r}; give a preset name or a SenseNovaConfig")
    cfg = preset_config(preset) if isinstance(preset, str) else preset
    device = device_arg(device, "build_model device")
    seed = int_arg("build_model seed", seed)
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise ConfigError(f"build_model dtype is {dtype!r}; use None (the preset's) or a floating torch dtype")
    check_quantization(quantization)
    model = SenseNovaLM(cfg, device, dtype, shard=shard)
    if checkpoint is None:
        random_init(model, seed, on=init_on)
    else:
        load_checkpoint(model, checkpoint, prefix=prefix, skip=skip)
    if quantization is not None:
        model.quantize(quantization)
    return model.eval()
