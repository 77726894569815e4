"""What a tensor-parallel engine is given instead of a model, and how each rank builds its share.

Every rank builds its own shard, so an engine with `tensor_parallel > 1` takes a *model source*:
- a preset name (`sensenova-u1-tiny`, `sensenova-u1-8b`), or through `load` a `SenseNovaConfig`:
  SenseNova-U1 with random weights drawn as one rank would draw them (every world size builds the
  same model);
- a model directory: SenseNova-U1 (by its config) or a transformers Llama / Qwen3, read slice by
  slice; a GGUF file is converted to such a directory first, once, on rank 0;
- a picklable callable `factory(shard) -> model` (a module-level function or a
  `functools.partial`), for anything else: it must return this rank's share.
`load(source, shard)` is the first two; `ModelSource` carries a source and its options across to
the other ranks' processes.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from batchkv.errors import ConfigError
from batchkv.models.config import SenseNovaConfig
from batchkv.tp.shard import Shard


def load(source: str | os.PathLike | SenseNovaConfig, shard: Shard, *, dtype: torch.dtype | None = None,
         seed: int = 0, kv_dtype: torch.dtype | None = None, quantization: str | None = None):  # fmt: skip
    """Rank `shard.rank`'s share of a preset or a `SenseNovaConfig` (random weights from `seed`), or
    of a model directory. `quantization="fp8"`: its projections in e4m3, each rank's scales computed
    from the slices it holds (per output channel, so a column-parallel slice's are the whole's)."""
    from batchkv.models import MODEL_PRESETS, build_model

    if isinstance(source, SenseNovaConfig) or str(source) in MODEL_PRESETS:
        preset = source if isinstance(source, SenseNovaConfig) else str(source)
        return build_model(preset, shard.device, dtype=dtype, seed=seed, shard=shard, quantization=quantization)
    from batchkv.serve.loading import GENERATION_BRANCH, _read_config, checkpoint_prefix, is_sensenova, sensenova_config

    path = Path(source)
    config = _read_config(path)
    if is_sensenova(config):
        cfg = sensenova_config(config, dtype)
        prefix = checkpoint_prefix(path)
        return build_model(cfg, shard.device, checkpoint=path, prefix=prefix, skip=(GENERATION_BRANCH,), shard=shard,
                           quantization=quantization)  # fmt: skip
    from batchkv.tp.hf import load_hf_shard

    return load_hf_shard(path, shard, dtype=dtype, kv_dtype=kv_dtype, quantization=quantization)


def resolve(source: str | os.PathLike) -> str:
    """A preset name or a model directory as `load` takes it: a GGUF file is converted (once, cached
    per machine) to a transformers directory. ConfigError for anything else."""
    from batchkv.models import MODEL_PRESETS

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
