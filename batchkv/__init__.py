"""batchkv: many sequences' KV cache in one column store, decoded by one captured CUDA graph."""

from batchkv.cache import BatchedSequenceCache, CacheConfig, LayerSpec
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
from batchkv.manifest import Manifest, from_manifest, load_manifest

__version__ = "0.1.0"

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
