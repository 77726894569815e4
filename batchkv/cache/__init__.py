"""The column store and BatchControl: `CacheConfig`, `LayerSpec`, `BatchedSequenceCache`, and the
single-sequence facade `PagedDecodeCache` (max_seqs = 1)."""

from batchkv.cache.batch import BatchedSequenceCache
from batchkv.cache.config import CacheConfig, LayerSpec
from batchkv.cache.single import PagedDecodeCache

__all__ = ["BatchedSequenceCache", "CacheConfig", "LayerSpec", "PagedDecodeCache"]
