"""batchkv: many sequences' KV cache in one column store, decoded by one captured CUDA graph."""

from batchkv.cache import BatchedSequenceCache, CacheConfig, LayerSpec
from batchkv.errors import (
    BatchKVError,
    CapacityError,
    ConfigError,
    ContractError,
    NoFreeColumnError,
    PositionError,
    RingFloorError,
    StepError,
    UnknownSequenceError,
    UnsupportedLayout,
)

__version__ = "0.1.0"

__all__ = [
    "BatchKVError",
    "BatchedSequenceCache",
    "CacheConfig",
    "CapacityError",
    "ConfigError",
    "ContractError",
    "LayerSpec",
    "NoFreeColumnError",
    "PositionError",
    "RingFloorError",
    "StepError",
    "UnknownSequenceError",
    "UnsupportedLayout",
]
