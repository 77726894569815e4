"""Drafter weights: seeded random init, checkpoint save and load by the published names, `build_drafter`."""

from __future__ import annotations

import json
import math
import os
import zlib
from pathlib import Path

import torch

from batchkv.errors import CheckpointError, ConfigError
from batchkv.models.dflash.config import DFlashConfig
from batchkv.models.dflash.model import DFlashDrafter
from batchkv.models.weights import _safetensors

_LAYER_NAMES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm",
                "self_attn.k_norm", "input_layernorm", "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj",
                "mlp.down_proj")  # fmt: skip


def target_geometry(target) -> dict:
    """hidden, heads, head_dim, intermediate, vocab, layers, rms_eps, rope_theta of a target model."""
    cfg = target.config
    if hasattr(cfg, "hidden_size"):  # a transformers config (HFModel)
        heads = cfg.num_attention_heads
        rope = getattr(cfg, "rope_theta", None) or (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta")
        return {"hidden": cfg.hidden_size, "q_heads": heads, "kv_heads": cfg.num_key_value_heads or heads,
                "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
                "intermediate": cfg.intermediate_size, "vocab": target.vocab_size, "layers": cfg.num_hidden_layers,
                "rms_eps": getattr(cfg, "rms_norm_eps", 1e-6), "rope_theta": float(rope or 1e6)}  # fmt: skip
    return {"hidden": cfg.hidden, "q_heads": cfg.q_heads, "kv_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
            "intermediate": cfg.intermediate, "vocab": cfg.vocab, "layers": cfg.num_layers, "rms_eps": cfg.rms_eps,
            "rope_theta": cfg.theta_t}  # fmt: skip


def default_target_layers(num_layers: int, count: int = 5) -> tuple[int, ...]:
    """`count` target layers evenly spaced from the first to the last (DFlash taps a few)."""
    count = min(count, num_layers)
    return tuple(sorted({round(i * (num_layers - 1) / max(1, count - 1)) for i in range(count)}))


def checkpoint_names(config: DFlashConfig) -> list[str]:
    """Every tensor name of a drafter checkpoint, in order."""
    names = ["fc.weight", "hidden_norm.weight"]
    for i in range(config.num_layers):
        names += [f"layers.{i}.{name}.weight" for name in _LAYER_NAMES]
    return [*names, "norm.weight"]


def _named(drafter: DFlashDrafter) -> dict[str, torch.Tensor]:
    params = dict(drafter.named_parameters())
    params["hidden_norm.weight"], params["norm.weight"] = params.pop("hidden_norm"), params.pop("norm")
    return params


@torch.no_grad()
def random_init(drafter: DFlashDrafter, seed: int = 0) -> None:
    """Projections N(0, 1/fan_in), norm weights 1 + 0.1 N(0, 1); one generator per (seed, name),
    drawn on the parameters' device (reproducible per device kind; fast for wide drafters)."""
    for name, p in _named(drafter).items():
        gen = torch.Generator(p.device).manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**62)
        draw = torch.randn(p.shape, generator=gen, device=p.device)
        p.copy_(1.0 + 0.1 * draw if p.dim() == 1 else draw / math.sqrt(p.shape[1]))


def save_drafter(drafter: DFlashDrafter, path: str | os.PathLike) -> None:
    """Write `config.json` and `model.safetensors` (the published names) into the folder `path`."""
    from safetensors.torch import save_file

    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(drafter.config.to_json(), indent=2))
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in _named(drafter).items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


@torch.no_grad()
def load_drafter_weights(drafter: DFlashDrafter, path: str | os.PathLike) -> None:
    """Load the safetensors of folder `path` by name; every name and shape is checked before any
    tensor is copied (CheckpointError, drafter unchanged). A file that is not a whole safetensors
    file is a CheckpointError naming it."""
    safe_open, unreadable = _safetensors()
    if not isinstance(path, (str, os.PathLike)):
        raise CheckpointError(f"checkpoint is {path!r}; give the path of a folder holding config.json and safetensors")
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors in {path}")
    params = _named(drafter)
    found: dict[str, tuple[str, tuple[int, ...]]] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                for key in handle.keys():  # noqa: SIM118 (a safe_open handle, not a dict)
                    found[key] = (str(file), tuple(handle.get_slice(key).get_shape()))
        except (unreadable, OSError) as exc:
            raise CheckpointError(f"{file} is not a readable safetensors file: {exc}") from exc
    missing = [n for n in params if n not in found]
    unexpected = sorted(n for n in found if n not in params)
    misshapen = [f"{n} {found[n][1]} != {tuple(p.shape)}" for n, p in params.items()
                 if n in found and found[n][1] != tuple(p.shape)]  # fmt: skip
    if missing or unexpected or misshapen:
        raise CheckpointError(f"DFlash checkpoint {path} does not match its config: missing {missing[:6]}, "
                              f"unexpected {unexpected[:6]}, misshapen {misshapen[:6]}")  # fmt: skip
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118
                params[key].copy_(handle.get_tensor(key))


def build_drafter(
    target,
    *,
    num_layers: int | None = None,
    target_layer_ids: tuple[int, ...] | None = None,
    block_size: int = 16,
    mask_token_id: int | None = None,
    seed: int = 0,
    checkpoint: str | os.PathLike | None = None,
    dtype: torch.dtype | None = None,
) -> DFlashDrafter:
    """A DFlash drafter for `target` (a `SenseNovaLM` or an `HFModel`), random from `seed` or loaded
    from `checkpoint` (a folder: config.json + safetensors; its config wins over the arguments).

    Geometry follows the target (hidden, heads, MLP width, vocab, RoPE base of its text axis).
    mask_token_id defaults to the last vocabulary id. dtype defaults to the target's.

    >>> drafter = build_drafter(model, num_layers=2, target_layer_ids=(0, 2), block_size=8)
    """
    geo = target_geometry(target)
    if checkpoint is not None:
        try:
            data = json.loads((Path(checkpoint) / "config.json").read_text())
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"cannot read {Path(checkpoint) / 'config.json'}: {exc}") from exc
        config = DFlashConfig.from_json(data)
    else:
        if num_layers is None or target_layer_ids is None:
            raise ConfigError("build_drafter needs num_layers and target_layer_ids (or a checkpoint)")
        config = DFlashConfig(
            hidden=geo["hidden"], num_layers=num_layers, q_heads=geo["q_heads"], kv_heads=geo["kv_heads"],
            head_dim=geo["head_dim"], intermediate=geo["intermediate"], vocab=geo["vocab"],
            target_layer_ids=tuple(target_layer_ids), block_size=block_size,
            mask_token_id=geo["vocab"] - 1 if mask_token_id is None else mask_token_id,
            rms_eps=geo["rms_eps"], rope_theta=geo["rope_theta"],
        )  # fmt: skip
    if (config.hidden, config.vocab) != (geo["hidden"], geo["vocab"]):
        raise ConfigError(f"the drafter's hidden/vocab {(config.hidden, config.vocab)} differ from the target's "
                          f"{(geo['hidden'], geo['vocab'])}: it shares the target's embedding and LM head")  # fmt: skip
    if max(config.target_layer_ids) >= geo["layers"]:
        raise ConfigError(f"target_layer_ids {config.target_layer_ids} reach past the target's {geo['layers']} layers")
    drafter = DFlashDrafter(config, target, target.device, dtype or target.dtype)
    if checkpoint is None:
        random_init(drafter, seed)
    else:
        load_drafter_weights(drafter, checkpoint)
    return drafter.eval()
