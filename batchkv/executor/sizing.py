"""Size the column store to the device: how many columns (and positions per column) fit.

`Engine(model, max_seqs="auto", memory_fraction=0.9)` works like vLLM's `gpu_memory_utilization`:
this process may use `memory_fraction` of the device's total memory for everything (weights,
activations, CUDA graphs and the KV store). What the process and others already hold is measured
(`torch.cuda.mem_get_info`), the activations of the widest step are measured by one forward
(`measure_activation_bytes`) and reserved twice over (the graph pool holds one copy of the widest
step's intermediates, eager warm-ups another), and the rest goes to K/V columns at full capacity,
so a sequence can always reach `capacity` without growing past the budget.

Store bytes are linear in the column count: every layer holds `rows_l x (max_seqs + 1) x Hkv x D`
elements of K and of V (the + 1 is the scratch column), with `rows_l = capacity` for flat layers and
the ring size for ring layers (`CacheConfig` owns both rules).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

from batchkv.cache import CacheConfig
from batchkv.errors import CapacityError, ConfigError

ACTIVATION_COPIES = 2  # widest step's intermediates: the graph pool's and an eager warm-up's
DEFAULT_CAPACITY = 4096  # positions per sequence when neither the caller nor the model says
# The step budget and prompt chunk of Engine, `batchkv run` and `batchkv serve` alike: the best of
# the H200 serving sweep at the 8B shape (bench/results/serve-sweep-h200.json, docs/design.md). A
# step packs only the tokens it has, so small CPU workloads take narrow steps all the same.
DEFAULT_STEP_TOKENS = 1024
DEFAULT_PREFILL_CHUNK = 512


def default_prefill_chunk(capacity: int, max_step_tokens: int) -> int:
    """DEFAULT_PREFILL_CHUNK, within the capacity and the step budget."""
    return min(DEFAULT_PREFILL_CHUNK, capacity, max_step_tokens)


@dataclass(frozen=True)
class Sizing:
    """What `plan` chose, and the numbers it chose from (bytes)."""

    max_seqs: int
    capacity: int
    budget: int  # total * memory_fraction
    in_use: int  # held on the device before the store (weights, context, other processes)
    activations: int  # reserved for step intermediates
    column_bytes: int  # one column at full capacity, every layer, K and V
    store_bytes: int  # the store at max_seqs columns (+ scratch) at full capacity

    def describe(self) -> str:
        gib = 2**30
        return (
            f"{self.max_seqs} sequences x {self.capacity} positions: store {self.store_bytes / gib:.2f} GiB "
            f"({self.column_bytes / gib:.3f} GiB per sequence) within {self.budget / gib:.1f} GiB, of which "
            f"{self.in_use / gib:.1f} GiB were in use and {self.activations / gib:.2f} GiB kept for activations"
        )


def column_bytes(config: CacheConfig) -> int:
    """Bytes one column holds at full capacity: every layer's rows, K and V."""
    per_row_column = config.bytes_per_row() // config.columns
    return sum(_full_rows(config, layer) for layer in range(config.num_layers)) * per_row_column // config.num_layers


def _full_rows(config: CacheConfig, layer: int) -> int:
    return config.ring_rows(layer) or config.capacity


def plan(
    config: CacheConfig,
    *,
    total: int,
    in_use: int,
    activations: int,
    memory_fraction: float,
    max_seqs: int | None = None,
) -> Sizing:
    """Columns (when `max_seqs` is None) for `config.capacity` positions each, within the budget.

    `config` is a template: its max_seqs is ignored. Refuses (CapacityError) when not even one
    sequence fits, naming what to lower. Pure arithmetic: no device is touched.
    """
    check_fraction(memory_fraction)
    budget = int(total * memory_fraction)
    per_column = column_bytes(replace(config, max_seqs=1))
    scratch = per_column if config.max_width > 1 else 0
    room = budget - in_use - ACTIVATION_COPIES * activations
    fit = (room - scratch) // per_column if room > scratch else 0
    if max_seqs is None:
        max_seqs = fit
    if max_seqs < 1 or max_seqs > fit:
        gib = 2**30
        raise CapacityError(
            f"{max(max_seqs, 1)} sequence(s) of {config.capacity} positions need "
            f"{(max(max_seqs, 1) * per_column + scratch) / gib:.2f} GiB of K/V, but only {max(room, 0) / gib:.2f} GiB "
            f"of the {budget / gib:.1f} GiB budget (memory_fraction={memory_fraction}) are left after "
            f"{in_use / gib:.1f} GiB in use and {ACTIVATION_COPIES * activations / gib:.2f} GiB for activations; "
            "lower capacity, raise memory_fraction or free device memory"
        )
    return Sizing(max_seqs, config.capacity, budget, in_use, ACTIVATION_COPIES * activations, per_column,
                  max_seqs * per_column + scratch)  # fmt: skip


def check_fraction(memory_fraction: float) -> None:
    """Refuse (ConfigError) a memory fraction outside (0, 1]."""
    number = isinstance(memory_fraction, (int, float)) and not isinstance(memory_fraction, bool)
    if not number or not 0 < memory_fraction <= 1:
        raise ConfigError(f"memory_fraction is {memory_fraction!r}; use a fraction in (0, 1], e.g. 0.9")


def model_capacity(model: object) -> int:
    """Positions per sequence when the caller gives none: the model's `max_positions` (e.g. a
    transformers config's max_position_embeddings) when it has one, else `DEFAULT_CAPACITY`."""
    return getattr(model, "max_positions", None) or DEFAULT_CAPACITY


def size_store(model, config: CacheConfig, memory_fraction: float, limit: int) -> tuple[CacheConfig, Sizing]:
    """`config` with as many columns as fit on its model's device (at most `limit`), and the
    `Sizing` that chose them: the device's memory in use now (weights loaded, store not yet
    allocated) and the activations of one forward at `config.max_width` are measured first."""
    device = torch.device(model.device)
    total, in_use = device_memory(device)
    rows = min(limit, config.max_width)
    activations = measure_activation_bytes(model, config, config.max_width, rows)
    fit = plan(config, total=total, in_use=in_use, activations=activations, memory_fraction=memory_fraction)
    chosen = plan(config, total=total, in_use=in_use, activations=activations, memory_fraction=memory_fraction,
                  max_seqs=min(fit.max_seqs, limit))  # fmt: skip
    return replace(config, max_seqs=chosen.max_seqs, max_segments=0), chosen


def device_memory(device: torch.device) -> tuple[int, int]:
    """(total, in use) bytes of `device`: CUDA from the driver, CPU from the OS (physical memory)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return total, total - free
    try:
        page, pages, free = os.sysconf("SC_PAGE_SIZE"), os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError) as exc:
        raise ConfigError(f"cannot read this machine's memory ({exc}); give max_seqs as a number") from exc
    return page * pages, page * (pages - free)


def measure_activation_bytes(model, config: CacheConfig, width: int, rows: int) -> int:
    """Peak bytes one eager forward of `width` tokens and `rows` logits rows allocates beyond what is
    held before it (CUDA; 0 elsewhere), with a one-column store of `width` positions as its cache."""
    from batchkv.cache import BatchedSequenceCache

    device = torch.device(model.device)
    if device.type != "cuda":
        return 0
    probe = replace(config, max_seqs=1, capacity=width, max_write=width, max_width=width, max_segments=0)
    cache = BatchedSequenceCache(probe, device)
    seq = cache.seq_new()
    cache.declare_step([seq] * width)
    cache.prepare_step(width)
    ids = torch.zeros(width, dtype=torch.int64, device=device)
    indexes = torch.zeros(3, width, dtype=torch.int64, device=device)
    logits_rows = torch.arange(rows, dtype=torch.int64, device=device)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    with torch.no_grad():
        model(ids, indexes, cache, logits_rows)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del cache
    torch.cuda.empty_cache()
    return max(peak, 0)
