"""The column store and BatchControl: `CacheConfig`, `LayerSpec`, `BatchedSequenceCache`."""

from batchkv.cache.batch import BatchedSequenceCache
from batchkv.cache.config import CacheConfig, LayerSpec

__all__ = ["BatchedSequenceCache", "CacheConfig", "LayerSpec"]
