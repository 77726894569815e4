"""batchkv: many sequences' KV cache in one column store, decoded by one captured CUDA graph.

The cache and manifest names are imported on first use (PEP 562), so `batchkv --help` and
`--version` answer without importing torch; `from batchkv import CacheConfig` works as usual.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from batchkv.errors import (
    BatchKVError,
    CapacityError,
    CheckpointError,
    ConfigError,
    ContractError,
    DependencyError,
    ManifestError,
    NoFreeColumnError,
    PositionError,
    RequestError,
    RingFloorError,
    StepError,
    UnknownSequenceError,
    UnsupportedLayout,
    WorkloadError,
)

if TYPE_CHECKING:
    from batchkv.cache import BatchedSequenceCache, CacheConfig, LayerSpec
    from batchkv.manifest import Manifest, from_manifest, load_manifest

__version__ = "0.1.0"

_LAZY = {  # name -> the module that defines it (each imports torch)
    "BatchedSequenceCache": "batchkv.cache",
    "CacheConfig": "batchkv.cache",
    "LayerSpec": "batchkv.cache",
    "Manifest": "batchkv.manifest",
    "from_manifest": "batchkv.manifest",
    "load_manifest": "batchkv.manifest",
}


def __getattr__(name: str):
    """The cache and manifest names, imported when first asked for."""
    if name not in _LAZY:
        raise AttributeError(f"module 'batchkv' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "BatchKVError",
    "BatchedSequenceCache",
    "CacheConfig",
    "CapacityError",
    "CheckpointError",
    "ConfigError",
    "ContractError",
    "DependencyError",
    "LayerSpec",
    "Manifest",
    "ManifestError",
    "NoFreeColumnError",
    "PositionError",
    "RequestError",
    "RingFloorError",
    "StepError",
    "UnknownSequenceError",
    "UnsupportedLayout",
    "WorkloadError",
    "from_manifest",
    "load_manifest",
]
