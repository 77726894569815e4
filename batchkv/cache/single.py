"""Single-sequence mode: the SenseNova-U1 paged-decode cache surface on the column store.

The SenseNova-U1 pipeline decodes one sequence per forward through a model-local paged cache
(vllm-omni's `paged_decode.py`): bucket-sized K/V buffers, the valid length and the write slot in
device tensors, so one captured CUDA graph serves every length in a bucket. `PagedDecodeCache`
keeps that surface -- same names, same meanings -- so the pipeline can switch without other
changes, and needs no vLLM wheel: attention is batchkv's `sdpa_varlen`, which takes any
head_dim that is a multiple of 16 from 16 to 256 rather than what one flash-attention build exports.

It is the degenerate case `max_seqs = 1` of the batched store, not a second cache: one
`BatchedSequenceCache` whose flat row schedule is the bucket schedule (`bucket` is its `rows`),
driven through the BatchControl verbs. `set_length(n)` holds n - 1 positions and stages a
one-token step, so `attend` writes slot n - 1 and reads [0, n) from the staged device buffers,
exactly as the original wrote at `length - 1` and attended `seqused` positions.

Costs against the original: storage is `[rows, 1, Hkv, D]` per layer, the original's bytes (a
store whose steps are one token wide never pads, so it has no scratch rows, and its pool is the one
sequence's extent); `set_length` is a
declare/prepare on the host (~20 us of Python and two small host-to-device copies) where the
original launched two `fill_`s.

When to delete this: once the pipeline drives its decode through a scheduler-visible runner, or
serves more than one sequence per forward, use `BatchedSequenceCache` and the executor directly.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from batchkv.cache.batch import BatchedSequenceCache
from batchkv.cache.config import CacheConfig
from batchkv.cache.store import Allocator
from batchkv.checks import device_arg, int_arg
from batchkv.errors import ContractError, PositionError

# Growth schedule, as the original. Each new bucket moves storage and costs one capture, so the
# list is short and the tail grows in steps instead of doubling: a request decodes at most 1024
# tokens, so a 2048 step costs at most one reallocation per request, and a 9,100-token request
# reserves 10,240 rows rather than the 16,384 doubling would.
BUCKETS = (512, 1024, 2048, 4096, 8192)
TAIL_STEP = 2048
# No capacity of its own: the schedule governs. kv_end lives in int32 seq_info.
_UNBOUNDED = 2**31 - 1


def bucket_for(length: int, buckets: tuple[int, ...] = BUCKETS, tail_step: int = TAIL_STEP) -> int:
    """Rows a schedule allocates to hold `length` positions (the original's `_bucket_for`)."""
    config = CacheConfig(1, 1, 1, max_seqs=1, capacity=_UNBOUNDED, buckets=tuple(buckets), tail_step=tail_step)
    return config.rows_for(length)


def _prefix(cache: Any) -> torch.Tensor | None:
    """Layer 0's keys [B, Hkv, S, D] of a transformers cache, or None when it holds nothing."""
    layers = getattr(cache, "layers", None)
    if not layers:
        return None
    keys = getattr(layers[0], "keys", None)
    if keys is None or keys.numel() == 0:
        return None
    return keys


class PagedDecodeCache:
    """K/V of one sequence for single-token decode, in a `max_seqs = 1` column store.

    Args: num_layers, kv_heads, head_dim, and `length` (positions to hold now: the first bucket
    that fits is allocated), device, dtype (the model's K/V dtype; storage too unless `kv_dtype`
    says otherwise, e.g. `torch.float8_e4m3fn`). `buckets`/`tail_step` set the schedule;
    `attention` picks the kernels ("auto": Triton on CUDA); `alloc` is the store's allocator.

    Attributes: `bucket` (rows allocated), `generation` (moves when storage moves; a graph keyed
    on an older one is stale), `length` (positions the next `attend` reads, its own included).
    `k[i]`, `v[i]` are [bucket, Hkv, D] views of layer i's column (position p at row p), in the
    storage dtype: e4m3 codes when `kv_dtype` is e4m3 (`to_dynamic_cache` dequantises).

    Example (the pipeline's loop):
        paged = PagedDecodeCache.from_dynamic_cache(dyn, num_layers, device, dtype)
        for token in ...:
            if paged.length + 1 > paged.bucket:
                paged.grow(paged.length + 1)
            paged.set_length(paged.length + 1)
            out = paged.attend(i, q, k, v, scale)      # inside the model, per layer i
        paged.to_dynamic_cache(dyn)

    Graph safety: `attend`/`update_and_attend` are capturable; everything else is host side.
    """

    def __init__(
        self,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        length: int,
        device: torch.device | str,
        dtype: torch.dtype,
        *,
        buckets: tuple[int, ...] = BUCKETS,
        tail_step: int = TAIL_STEP,
        attention: str = "auto",
        alloc: Allocator = torch.empty,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        length = int_arg("PagedDecodeCache length", length, 0, _UNBOUNDED)
        self.device, self.dtype = device_arg(device, "PagedDecodeCache device"), dtype
        self.schedule = CacheConfig(
            num_layers, kv_heads, head_dim, max_seqs=1, capacity=_UNBOUNDED, max_write=1, dtype=dtype,
            kv_dtype=kv_dtype, max_width=1, buckets=tuple(buckets), tail_step=tail_step,
        )  # fmt: skip
        config = self.schedule
        if config.buckets:
            # Start the store's schedule at the first bucket this cache needs, so construction
            # allocates once; it grows through the full schedule's rows afterwards (first is one).
            first = self.bucket_for(length)
            start = tuple(b for b in config.buckets if b >= first) or (first,)
            config = dataclasses.replace(config, buckets=start)
        self._cache = BatchedSequenceCache(config, self.device, attention=attention, alloc=alloc)
        self.num_layers, self.kv_heads, self.head_dim = config.num_layers, config.kv_heads, config.head_dim
        self._seq = self._cache.seq_new()
        self._length = 0

    # ---- geometry -----------------------------------------------------------------------------
    def bucket_for(self, length: int) -> int:
        """Rows the schedule allocates to hold `length` positions."""
        return self.schedule.rows_for(int_arg("bucket_for: length", length, 0, error=PositionError))

    @property
    def inner(self) -> BatchedSequenceCache:
        """The `max_seqs = 1` BatchedSequenceCache underneath."""
        return self._cache

    @property
    def bucket(self) -> int:
        return self._cache.reach(self._seq)

    @property
    def generation(self) -> int:
        return self._cache.generation

    @property
    def length(self) -> int:
        return self._length

    @property
    def k(self) -> list[torch.Tensor]:
        return [self._cache.column(self._seq, i)["k"] for i in range(self.num_layers)]

    @property
    def v(self) -> list[torch.Tensor]:
        return [self._cache.column(self._seq, i)["v"] for i in range(self.num_layers)]

    @property
    def seqused(self) -> torch.Tensor:
        """Device int32 [1]: positions the staged step attends (a view of the staged seq_info)."""
        return self._cache.seq_info[0, 3:4]

    @property
    def pos(self) -> torch.Tensor:
        """Device int64 [1]: the staged write position (empty while no step is staged)."""
        return self._cache.positions

    def reusable_for(self, num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, length: int) -> bool:
        """Can this cache serve another request without reallocating?

        Reusing the buffers is what lets captured graphs survive across requests: a capture binds
        the addresses it recorded, so a fresh cache forces a fresh capture.
        """
        return (
            self.num_layers == num_layers
            and self.kv_heads == kv_heads
            and self.head_dim == head_dim
            and self.dtype == dtype
            and self.bucket_for(length) <= self.bucket
        )

    # ---- host side ----------------------------------------------------------------------------
    def set_length(self, n: int) -> None:
        """Make the next `attend` write position n - 1 and read positions [0, n).

        The sequence holds n - 1 positions and a one-token step is staged in device buffers. A
        forward jump keeps whatever the rows already hold, as in the original; n = 0 stages
        nothing. Past the bucket, storage grows first (as `grow(n)` would). Host side.
        """
        n = int_arg("set_length: n", n, 0, error=PositionError)
        if n > self.bucket:
            self._cache.reserve(self._seq, self.bucket_for(n))  # a refusal here leaves everything as it was
        self._cache._set_length(self._seq, max(n - 1, 0))
        if n:
            self._cache.declare_step([self._seq])
            self._cache.prepare_step(1)
        self._length = n

    def grow(self, length: int) -> bool:
        """Move to the bucket that holds `length`, keeping the tokens already stored.

        Atomic: every new buffer is built and filled before any is published, and `generation`
        moves with them, so a failed allocation (a `CapacityError` for out-of-memory) leaves the
        cache, its generation and every graph keyed on it as they were. False when the bucket
        already fits.
        """
        if self.bucket_for(length) <= self.bucket:  # bucket_for refuses a non-integer length
            return False
        self._cache.reserve(self._seq, self.bucket_for(length))
        self.set_length(self._length)  # re-stage over the new storage
        return True

    def load_prefix(self, cache: Any) -> bool:
        """Copy a prefill cache (transformers `DynamicCache`: layers of [1, Hkv, S, D]) in.

        Length becomes S. Rows past S keep what the previous request wrote; nothing reads them.
        Grows when S does not fit the bucket. Returns False for an empty cache.
        """
        keys = _prefix(cache)
        if keys is None:
            return False
        layers = cache.layers
        if len(layers) < self.num_layers:
            raise ContractError(f"load_prefix: need {self.num_layers} layers; got {len(layers)}")
        for i in range(self.num_layers):  # every layer: the original took batch row 0 of whatever it found
            for name in ("keys", "values"):
                t = getattr(layers[i], name, None)
                if not isinstance(t, torch.Tensor) or t.dim() != 4 or t.shape[0] != 1:
                    got = list(t.shape) if isinstance(t, torch.Tensor) else repr(t)
                    raise ContractError(
                        f"load_prefix: layer {i} {name} must be [batch 1, Hkv, S, D] like layer 0's; got {got}"
                    )
        # [1, Hkv, S, D] -> [S, Hkv, D] per layer
        ks = [layers[i].keys[0].transpose(0, 1) for i in range(self.num_layers)]
        vs = [layers[i].values[0].transpose(0, 1) for i in range(self.num_layers)]
        self._cache._load_prefix(self._seq, ks, vs)
        self.set_length(keys.shape[2])
        return True

    @classmethod
    def from_dynamic_cache(
        cls,
        cache: Any,
        num_layers: int,
        device: torch.device | str,
        dtype: torch.dtype,
        min_length: int = 0,
        **options: Any,
    ) -> PagedDecodeCache | None:
        """Allocate for a prefill cache (room for at least one more token) and copy it in.

        None for an empty cache. `options` go to the constructor (buckets, tail_step, ...).
        """
        keys = _prefix(cache)
        if keys is None:
            return None
        _, kv_heads, prefix, head_dim = keys.shape
        min_length = int_arg("from_dynamic_cache: min_length", min_length, 0, _UNBOUNDED)
        obj = cls(num_layers, kv_heads, head_dim, max(prefix + 1, min_length), device, dtype, **options)
        obj.load_prefix(cache)
        return obj

    def to_dynamic_cache(self, cache: Any) -> None:
        """Write the decoded K/V back, [1, Hkv, length, D] per layer in `dtype`, into `cache.layers`.

        Only decode runs here; the stage after it (the DiT) reads the ordinary cache, so the two
        are reconciled once at the hand-off rather than kept in sync on every step. A lazily
        built transformers cache gets its missing layers first.
        """
        layers = cache.layers
        make = getattr(cache, "layer_class_to_replicate", None)
        if len(layers) < self.num_layers and make is None:
            raise ContractError(f"to_dynamic_cache: the cache has {len(layers)} layers, not {self.num_layers}")
        while len(layers) < self.num_layers:
            layers.append(make())
        all_keys, all_values = self._cache._read_prefix(self._seq, self._length)  # [n, Hkv, D], dequantised
        for i in range(self.num_layers):
            layer = layers[i]
            keys = all_keys[i].transpose(0, 1).unsqueeze(0).contiguous()
            values = all_values[i].transpose(0, 1).unsqueeze(0).contiguous()
            if getattr(layer, "is_initialized", True) is False:
                try:
                    layer.lazy_initialization(keys, values)
                except TypeError:  # transformers < 5 takes the keys only
                    layer.lazy_initialization(keys)
            layer.keys, layer.values = keys, values

    # ---- device side (capturable) -------------------------------------------------------------
    def attend(
        self,
        layer_idx: int,
        query_bhsd: torch.Tensor,
        key_bhsd: torch.Tensor,
        value_bhsd: torch.Tensor,
        softmax_scale: float,
    ) -> torch.Tensor:
        """Write this step's K/V at position length - 1, then attend over [0, length).

        query_bhsd [1, Hq, 1, D]; key_bhsd, value_bhsd [1, Hkv, 1, D]. Returns [1, 1, Hq, D] in the
        query's dtype. The slot and the attended length are read from device tensors staged by
        `set_length`, so a captured graph reads what they hold at replay, not at capture.
        """
        kv = (1, self.kv_heads, 1, self.head_dim)
        shapes = [tuple(getattr(t, "shape", ())) for t in (query_bhsd, key_bhsd, value_bhsd)]
        query_ok = len(shapes[0]) == 4 and shapes[0][0::2] == (1, 1) and shapes[0][3] == self.head_dim
        if not query_ok or shapes[1:] != [kv, kv]:
            raise ContractError(
                f"attend: query must be [1, Hq, 1, {self.head_dim}] and key, value {list(kv)} (one token of one "
                f"sequence); got {', '.join(str(list(s)) for s in shapes)}"
            )
        heads, dim = query_bhsd.shape[1], query_bhsd.shape[3]
        q = query_bhsd.reshape(1, heads, dim).contiguous()  # [W=1, Hq, D]
        k = key_bhsd.reshape(1, self.kv_heads, dim).contiguous()
        v = value_bhsd.reshape(1, self.kv_heads, dim).contiguous()
        out = self._cache.update_and_attend(layer_idx, q, k, v, scale=softmax_scale)
        return out.reshape(1, 1, heads, dim)

    def update_and_attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float | None = None,
        causal: bool = True,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The batchkv cache protocol (q [1, Hq, D], k/v [1, Hkv, D] -> [1, Hq, D]) for batchkv models;
        softcap and sinks as `BatchedSequenceCache.update_and_attend` takes them."""
        return self._cache.update_and_attend(layer, q, k, v, scale=scale, causal=causal, softcap=softcap, sinks=sinks)
