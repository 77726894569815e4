"""Which transformers models `HFModel` refuses at construction, and why: a non-causal config, an
attention class whose forward does not dispatch through transformers' `AttentionInterface` (the
cache would never see its keys), and soft-capping or sinks that the attention forward does not hand
to the attention function. Read from the model's modules and their forwards' source, before any
step runs; `tests/test_model_coverage.py` holds the table of architectures served and refused."""

from __future__ import annotations

import inspect

import torch

from batchkv.errors import ConfigError


def refuse_unsupported(config) -> None:
    """ConfigError for a non-causal config (every model served attends causally)."""
    if getattr(config, "is_causal", True) is False:
        raise ConfigError(f"{config.model_type}: a non-causal config (is_causal=False) cannot be served")


def _attention_classes(hf_model: torch.nn.Module) -> list[type]:
    """The classes of the model's attention modules (named `...Attention`), in first-seen order."""
    seen: dict[type, None] = {}
    for module in hf_model.modules():
        if type(module).__name__.endswith("Attention"):
            seen.setdefault(type(module), None)
    return list(seen)


def _forward_source(cls: type) -> str | None:
    """The source of `cls.forward`, or None where Python cannot show it (then nothing is inferred)."""
    try:
        return inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return None


def refuse_unrouted_attention(hf_model: torch.nn.Module) -> None:
    """ConfigError, naming the architecture, for a model whose attention would not reach the cache:
    an attention class whose forward does not dispatch through transformers' `AttentionInterface`
    (Falcon picks its kernels by the implementation's name and would attend within the step only),
    a soft-capping config whose attention does not pass the cap on, or attention modules holding sinks
    that their forward does not hand over."""
    config = hf_model.config
    arch = f"{type(hf_model).__name__} ({config.model_type})"
    for cls in _attention_classes(hf_model):
        source = _forward_source(cls)
        if source is not None and "ALL_ATTENTION_FUNCTIONS" not in source:
            raise ConfigError(
                f"{arch}: {cls.__name__} does not dispatch through transformers' AttentionInterface (it picks "
                "its attention kernel itself), so the batchkv cache would never see its keys; this architecture "
                "cannot be served through HFModel"
            )
        modules = [m for m in hf_model.modules() if type(m) is cls]
        has_sinks = any(isinstance(getattr(m, "sinks", None), torch.Tensor) for m in modules)
        if source is not None and has_sinks and "sinks" not in source:
            raise ConfigError(
                f"{arch}: {cls.__name__} holds attention sinks but its forward does not hand them to the attention "
                "function; it cannot be served as configured"
            )
        if source is not None and getattr(config, "attn_logit_softcapping", None) and "softcap" not in source:
            raise ConfigError(
                f"{arch}: attn_logit_softcapping={config.attn_logit_softcapping} is set but {cls.__name__} does "
                "not pass a soft-cap to the attention function; it cannot be served as configured"
            )
