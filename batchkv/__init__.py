"""batchkv: many sequences' KV cache in one column store, decoded by one captured CUDA graph."""

from batchkv.cache import BatchedSequenceCache, CacheConfig, LayerSpec
from batchkv.errors import (
    BatchKVError,
    CapacityError,
    ConfigError,
    ContractError,
    ManifestError,
    NoFreeColumnError,
    PositionError,
    RingFloorError,
    StepError,
    UnknownSequenceError,
    UnsupportedLayout,
)

__version__ = "0.1.0"

_MANIFEST_NAMES = ("Manifest", "from_manifest", "load_manifest")


def __getattr__(name: str) -> object:
    # Manifests need msgspec; importing them on first use keeps `import batchkv` working without it.
    if name in _MANIFEST_NAMES:
        import batchkv.manifest

        return getattr(batchkv.manifest, name)
    raise AttributeError(f"module 'batchkv' has no attribute {name!r}")


__all__ = [
    "BatchKVError",
    "BatchedSequenceCache",
    "CacheConfig",
    "CapacityError",
    "ConfigError",
    "ContractError",
    "LayerSpec",
    "Manifest",
    "ManifestError",
    "NoFreeColumnError",
    "PositionError",
    "RingFloorError",
    "StepError",
    "UnknownSequenceError",
    "UnsupportedLayout",
    "from_manifest",
    "load_manifest",
]
