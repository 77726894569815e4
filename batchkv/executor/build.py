"""How `Engine.__init__` builds an engine, one step per function, in the order it runs them:

1. `check_shape`: the options checked and the step's geometry worked out (`Shape`: sequences,
   capacity, step budget, prompt chunk, width buckets, logits rows and the store's `CacheConfig`);
2. `size_store`: the store's positions (`kv_positions`: "auto" from the device's memory, a number,
   or grown on demand) and, with `max_seqs="auto"`, its sequences;
3. `graph_set`: the CUDA graphs, when the device and the attention can capture them;
4. `build_scheduler`, then `build_runner`: the scheduler, and the runner (its step buffers) or the
   speculator that brings its own verify runner.

Each refuses what it checks with the same typed error and message as before the split, and in the
same order; nothing here holds state of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from batchkv.cache import BatchedSequenceCache, CacheConfig
from batchkv.cache.config import MAX_POSITIONS, MAX_STEP_TOKENS
from batchkv.checks import allocating, device_arg, int_arg, int_args
from batchkv.errors import ConfigError
from batchkv.executor import sizing
from batchkv.executor.graphs import GraphSet
from batchkv.executor.metrics import Metrics
from batchkv.executor.request import MAX_SAMPLE_ROWS, StepModel
from batchkv.executor.roles import Role
from batchkv.executor.rows import HEAD_CHUNK, chunkable
from batchkv.executor.runner import ModelRunner
from batchkv.executor.scheduler import Scheduler
from batchkv.executor.speculative import NoSpeculation, SpeculativeConfig, Speculator, build_speculator
from batchkv.executor.speculative.config import MAX_SPECULATIVE_ROWS


@dataclass(frozen=True)
class Shape:
    """An engine's checked options and step geometry (what `check_shape` works out)."""

    config: CacheConfig  # the store's, before sizing (max_seqs, capacity, max_write, max_width, ...)
    max_step_tokens: int
    prefill_chunk: int
    buckets: tuple[int, ...]  # packed step widths
    seed: int
    row_cap: int  # most sampling rows a step takes: MAX_SAMPLE_ROWS, or MAX_SPECULATIVE_ROWS speculating
    auto: bool  # max_seqs="auto": sizing picks the sequences
    kv_positions: int | str | None

    @property
    def sample_rows(self) -> int:
        """Logits rows per step (sampling rows, then prompt scoring rows): min(row cap, max_seqs)."""
        return min(self.row_cap, self.config.max_seqs)


def check_shape(
    model: StepModel,
    *,
    max_seqs: int | str,
    capacity: int | None,
    max_step_tokens: int | str,
    prefill_chunk: int | None,
    width_buckets: Sequence[int] | None,
    use_graphs: bool | str,
    row_buckets: tuple[int, ...],
    row_step: int,
    seed: int,
    kv_dtype: torch.dtype | None,
    speculative: SpeculativeConfig | None,
    kv_positions: int | str | None,
) -> Shape:
    """Check the engine's sizing options (ConfigError naming the option and the fix) and work out
    the step's geometry and the store's `CacheConfig`. "auto" sequences start at MAX_SAMPLE_ROWS
    (`size_store` settles them) and take `kv_positions="auto"` unless it is given."""
    auto = max_seqs == "auto"
    if auto:
        max_seqs, kv_positions = MAX_SAMPLE_ROWS, "auto" if kv_positions is None else kv_positions
    capacity = sizing.model_capacity(model) if capacity is None else capacity
    max_seqs = int_arg("Engine max_seqs", max_seqs, 1, MAX_POSITIONS, why=" (or 'auto')")
    why = " (one step's tokens: static buffers are sized by it; or 'auto')"
    max_step_tokens = sizing.auto_step_tokens(model) if max_step_tokens == "auto" else max_step_tokens
    max_step_tokens = int_arg("Engine max_step_tokens", max_step_tokens, 1, MAX_STEP_TOKENS, why=why)
    why = " (a prompt and a generated token; positions are int32)"
    capacity = int_arg("Engine capacity", capacity, 2, MAX_POSITIONS, why=why)
    why = f" (at most capacity={capacity} and max_step_tokens={max_step_tokens})"
    if prefill_chunk is None:
        prefill_chunk = sizing.default_prefill_chunk(capacity, max_step_tokens)
    prefill_chunk = int_arg("Engine prefill_chunk", prefill_chunk, 1, min(capacity, max_step_tokens), why=why)
    seed = int_arg("Engine seed", seed)
    row_buckets = int_args("Engine row_buckets", row_buckets, 1, MAX_POSITIONS)
    row_step = int_arg("Engine row_step", row_step, 0, MAX_POSITIONS)
    if speculative is not None and not isinstance(speculative, SpeculativeConfig):
        raise ConfigError(f"speculative is a {type(speculative).__name__}; pass a SpeculativeConfig or None")
    block = speculative.block_size if speculative is not None else 1
    if block > capacity:
        raise ConfigError(f"speculative block_size {block} exceeds capacity {capacity}; lower block_size")
    row_cap = MAX_SAMPLE_ROWS if speculative is None else MAX_SPECULATIVE_ROWS
    buckets = _buckets(width_buckets, max_step_tokens + min(row_cap, max_seqs) * (block - 1))
    if use_graphs != "auto" and not isinstance(use_graphs, bool):
        raise ConfigError(f"use_graphs is {use_graphs!r}; use 'auto', True or False")
    spec = model.cache_spec()
    config = CacheConfig(
        num_layers=spec["num_layers"],
        kv_heads=spec["kv_heads"],
        head_dim=spec["head_dim"],
        value_dim=spec.get("value_dim", 0),
        max_seqs=max_seqs,
        capacity=capacity,
        max_write=max(prefill_chunk, block),
        layers=tuple(spec.get("layers") or ()),
        dtype=spec.get("dtype", torch.bfloat16),
        kv_dtype=kv_dtype or spec.get("kv_dtype"),
        max_width=buckets[-1],
        buckets=tuple(row_buckets),
        tail_step=row_step,
    )
    return Shape(config, max_step_tokens, prefill_chunk, buckets, seed, row_cap, auto, kv_positions)


def _buckets(width_buckets: Sequence[int] | None, widest: int) -> tuple[int, ...]:
    """The step widths: `width_buckets` checked, or `default_buckets(widest)`."""
    if width_buckets is not None:
        buckets = int_args("Engine width_buckets", width_buckets, 1, MAX_STEP_TOKENS)
    else:
        buckets = sizing.default_buckets(widest)
    if not buckets or list(buckets) != sorted(set(buckets)) or buckets[-1] < widest:
        raise ConfigError(
            f"width_buckets {buckets} must be positive, strictly increasing and reach "
            f"{widest} (max_step_tokens, plus drafts when speculating; add {widest})"
        )
    return tuple(buckets)


def engine_device(model: StepModel, device: torch.device | str | None) -> torch.device:
    """The engine's device (default: the model's); ConfigError when the model is on another kind."""
    engine = device_arg(device if device is not None else model.device, "Engine device")
    if torch.device(model.device).type != engine.type:
        raise ConfigError(f"the model is on {model.device} but the engine's device is {engine}; move one")
    return engine


def size_store(
    model: StepModel, shape: Shape, memory_fraction: float, role: Role
) -> tuple[CacheConfig, sizing.Sizing | None]:
    """The store's `CacheConfig` with its positions, and the `Sizing` when chosen from the device's
    memory (`kv_positions="auto"`). An int allocates that many positions whole; None leaves the
    store to grow on demand. With `max_seqs="auto"` the sequences follow the positions
    (`sizing.auto_rows`)."""
    sizing.check_fraction(memory_fraction)
    config, kv_positions = shape.config, shape.kv_positions
    if kv_positions == "auto":  # as many positions as fit, allocated whole now: no growth while serving
        head_rows = min(shape.sample_rows, HEAD_CHUNK) if chunkable(model) else shape.sample_rows
        step_tokens = shape.max_step_tokens if shape.auto else None
        return sizing.size_store(model, config, memory_fraction, head_rows, agree=role.agree, step_tokens=step_tokens)
    if kv_positions is not None:
        why = " (or 'auto', or None: grown on demand)"
        kv_positions = int_arg("Engine kv_positions", kv_positions, config.capacity, MAX_POSITIONS, why=why)
        if shape.auto:  # the sequences those positions hold, as sizing picks them
            seqs = sizing.auto_rows(kv_positions, config.capacity, shape.max_step_tokens)
            config = replace(config, max_seqs=seqs, max_segments=0)
        config = replace(config, pool_rows=kv_positions + config.scratch_rows)
    return config, None


def graph_set(cache: BatchedSequenceCache, use_graphs: bool | str, role: Role) -> GraphSet | None:
    """The engine's CUDA graphs: a `GraphSet` on CUDA with capturable attention unless use_graphs
    is False; None otherwise (use_graphs=True there is a ConfigError)."""
    capturable = cache.device.type == "cuda" and cache.attention != "reference"
    if use_graphs is True and not capturable:
        raise ConfigError(
            f"use_graphs=True needs CUDA and capturable attention; device is {cache.device}, "
            f"attention is {cache.attention!r} (use use_graphs='auto' or False)"
        )
    if use_graphs is False or not capturable:
        return None
    return GraphSet(cache.device, capture_error_mode=role.capture_error_mode)


def build_scheduler(
    cache: BatchedSequenceCache,
    shape: Shape,
    prefill_budget: int | None,
    prefix_cache: bool,
    speculative: SpeculativeConfig | None,
) -> Scheduler:
    """The engine's scheduler over `cache`; the prefix cache is off under a DFlash drafter (its own
    cache would lack the reused positions' context features)."""
    if not isinstance(prefix_cache, bool):
        raise ConfigError(f"prefix_cache is {prefix_cache!r}; use True or False")
    reuse = prefix_cache and not (speculative is not None and speculative.method == "dflash")
    rows = min(shape.row_cap, cache.max_seqs)
    return Scheduler(
        cache, shape.max_step_tokens, shape.prefill_chunk, shape.buckets, prefill_budget, rows, prefix_cache=reuse
    )


def build_runner(
    model: StepModel,
    cache: BatchedSequenceCache,
    shape: Shape,
    graphs: GraphSet | None,
    speculative: SpeculativeConfig | None,
    metrics: Metrics,
    role: Role,
) -> tuple[ModelRunner, Speculator | NoSpeculation]:
    """The runner (its step buffers allocated; CapacityError naming the bytes when they do not
    fit) and the speculator, whose verify runner is the runner when speculating."""
    buckets, rows = shape.buckets, min(shape.row_cap, cache.max_seqs)
    nbytes = ModelRunner.nbytes(buckets[-1], int(model.vocab_size), rows, rows > HEAD_CHUNK and chunkable(model))
    with allocating("the step inputs and logits", nbytes, "lower max_step_tokens, or free device memory"):
        if speculative is None:
            pad_rows = cache.device.type == "cuda"
            runner = ModelRunner(model, cache, buckets[-1], graphs=graphs, pad_rows=pad_rows, rows=rows, role=role)
            return runner, NoSpeculation()
        speculator = build_speculator(
            speculative,
            model,
            graphs,
            cache=cache,
            metrics=metrics,
            buckets=buckets,
            prefill_chunk=shape.prefill_chunk,
            role=role,
        )
        return speculator.runner, speculator
