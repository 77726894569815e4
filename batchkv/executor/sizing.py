"""Size the store to the device: how many positions the pools hold for all sequences together.

`Engine(model, max_seqs="auto", memory_fraction=0.9)` works like vLLM's `gpu_memory_utilization`:
this process may use `memory_fraction` of the device's total memory for everything (weights,
activations, CUDA graphs and the KV store). What the process and others already hold is measured
(`torch.cuda.mem_get_info`), the activations of the widest step are measured by one forward
(`measure_activation_bytes`) and reserved twice over (the graph pool holds one copy of the widest
step's intermediates, eager warm-ups another), and the rest goes to the store's pools, allocated
whole: serving then never grows storage (or recaptures a graph), and a request waits for rows
rather than the store growing past the budget.

A position costs `CacheConfig.layer_row_bytes()` in every layer: the flat layers' pool holds P rows
(every sequence's extent and the scratch rows), a ring layer's pool min(P, max_seqs x ring + scratch)
(no extent is taller than its ring), so the store's bytes grow with P and `plan` takes the largest
P that fits. A request of reach r then costs r rows (a ring layer's at most its ring), whatever the
other requests' lengths.

With `max_seqs="auto"` the sequences (and so the logits rows a step samples) are chosen after the
positions: `auto_rows` takes MAX_SAMPLE_ROWS (1,024), fewer when the step's token budget is smaller
or the store cannot hold that many requests of AUTO_REACH positions (columns past that would
never fill).

Also the step widths an engine (and a DFlash drafter's own cache) pads to: `default_buckets`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from batchkv.cache import CacheConfig
from batchkv.errors import CapacityError, ConfigError
from batchkv.executor.request import MAX_SAMPLE_ROWS

ACTIVATION_COPIES = 2  # widest step's intermediates: the graph pool's and an eager warm-up's
DEFAULT_CAPACITY = 4096  # positions per sequence when neither the caller nor the model says
# The step budget and prompt chunk of Engine, `batchkv run` and `batchkv serve` alike: the best of
# the H200 serving sweep at the 8B shape (bench/results/serve-sweep-h200.json, docs/design.md). A
# step packs only the tokens it has, so small CPU workloads take narrow steps all the same.
DEFAULT_STEP_TOKENS = 1024
DEFAULT_PREFILL_CHUNK = 512
# max_step_tokens="auto" (the command line's default): a step whose matmuls take about as long as
# DEFAULT_STEP_TOKENS tokens through the 8B shape's 16 GB of bf16 weights. Their time follows the
# weights' bytes (the elements set the FLOPs, the element width the rate), so a model of fewer bytes
# takes more tokens a step, in powers of two up to MOST_AUTO_STEP_TOKENS: fewer, larger prompt steps
# where a step costs little (SmolLM2's 0.27 GB take 8,192).
AUTO_STEP_WEIGHT_BYTES = 16 * 10**9
MOST_AUTO_STEP_TOKENS = 8192
# The reach (prompt + output positions) of a short request, which max_seqs="auto" sizes its row
# count for: a store that cannot hold MAX_SAMPLE_ROWS requests of this many positions gets fewer rows.
AUTO_REACH = 512


def auto_rows(positions: int, capacity: int, max_step_tokens: int) -> int:
    """max_seqs="auto"'s sequences, each sampled every step: MAX_SAMPLE_ROWS, at most the step's
    token budget (a step decodes no more) and as many requests of min(capacity, AUTO_REACH)
    positions as `positions` hold; at least one."""
    return max(1, min(MAX_SAMPLE_ROWS, max_step_tokens, positions // min(capacity, AUTO_REACH)))


def auto_step_tokens(model: object) -> int:
    """max_step_tokens="auto"'s budget for `model` (see AUTO_STEP_WEIGHT_BYTES): DEFAULT_STEP_TOKENS
    off CUDA and for a model whose weights it cannot count, else doubled while a step of twice the
    tokens through the model's weights costs at most what DEFAULT_STEP_TOKENS through 16 GB do."""
    weights = weight_bytes(model)
    if torch.device(getattr(model, "device", "cpu")).type != "cuda" or not weights:
        return DEFAULT_STEP_TOKENS
    tokens = DEFAULT_STEP_TOKENS
    while tokens < MOST_AUTO_STEP_TOKENS and 2 * tokens * weights <= DEFAULT_STEP_TOKENS * AUTO_STEP_WEIGHT_BYTES:
        tokens *= 2
    return tokens


def weight_bytes(model: object) -> int:
    """Bytes of the model's parameters and buffers (fp8 weights are buffers): an nn.Module's own, or
    those of the transformers module it wraps (`HFModel.hf`); 0 for a model that is neither."""
    module = model if isinstance(model, torch.nn.Module) else getattr(model, "hf", None)
    if not isinstance(module, torch.nn.Module):
        return 0
    return sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))


def default_prefill_chunk(capacity: int, max_step_tokens: int) -> int:
    """DEFAULT_PREFILL_CHUNK, within the capacity and the step budget."""
    return min(DEFAULT_PREFILL_CHUNK, capacity, max_step_tokens)


@dataclass(frozen=True)
class Sizing:
    """What `plan` chose, and the numbers it chose from (bytes)."""

    max_seqs: int
    capacity: int
    positions: int  # rows of the flat pool that extents may take (the scratch rows excluded)
    budget: int  # total * memory_fraction
    in_use: int  # held on the device before the store (weights, context, other processes)
    activations: int  # reserved for step intermediates
    position_bytes: int  # one position of one sequence, every layer (a flat layer's worth for rings)
    store_bytes: int  # the store: every layer's pool

    def describe(self) -> str:
        gib = 2**30
        full = min(self.max_seqs, self.positions // self.capacity)
        return (
            f"a pool of {self.positions} positions for at most {self.max_seqs} sequences ({full} at the full "
            f"{self.capacity} positions, or more shorter ones): store {self.store_bytes / gib:.2f} GiB "
            f"({self.position_bytes / 2**10:.1f} KiB per position) within {self.budget / gib:.1f} GiB, of which "
            f"{self.in_use / gib:.1f} GiB were in use and {self.activations / gib:.2f} GiB kept for activations"
        )


def store_bytes(config: CacheConfig, pool_rows: int) -> int:
    """Bytes of every layer's pool when the flat pool has `pool_rows` rows (what `ColumnStore`
    allocates for a `CacheConfig(pool_rows=pool_rows)`)."""
    sized = replace(config, pool_rows=pool_rows)
    rows = sum(sized.max_pool_rows(sized.ring_rows(layer)) for layer in range(config.num_layers))
    return rows * config.layer_row_bytes()


def plan(
    config: CacheConfig,
    *,
    total: int,
    in_use: int,
    activations: int,
    memory_fraction: float,
    positions: int | None = None,
) -> Sizing:
    """The pool's positions (when `positions` is None: as many as fit) for `config.max_seqs`
    sequences within the budget.

    Refuses (CapacityError) when not even one sequence at full capacity fits, or the asked
    `positions` do not, naming what to lower. Pure arithmetic: no device is touched.
    """
    check_fraction(memory_fraction)
    budget = int(total * memory_fraction)
    room = budget - in_use - ACTIVATION_COPIES * activations
    scratch = config.scratch_rows
    most = config.max_seqs * config.capacity  # every sequence at full capacity: more rows would idle
    lo, hi = 0, most
    while lo < hi:  # the largest position count whose pools fit the room (bytes grow with it)
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if store_bytes(config, mid + scratch) <= room else (lo, mid - 1)
    fit = lo
    want = fit if positions is None else positions
    if want < config.capacity or want > fit:
        gib = 2**30
        need = max(want, config.capacity)
        raise CapacityError(
            f"{need} positions of K/V (one sequence of {config.capacity} at least) need "
            f"{store_bytes(config, need + scratch) / gib:.2f} GiB, but only {max(room, 0) / gib:.2f} GiB of the "
            f"{budget / gib:.1f} GiB budget (memory_fraction={memory_fraction}) are left after {in_use / gib:.1f} GiB "
            f"in use and {ACTIVATION_COPIES * activations / gib:.2f} GiB for activations; lower capacity, raise "
            "memory_fraction or free device memory"
        )
    return Sizing(config.max_seqs, config.capacity, want, budget, in_use, ACTIVATION_COPIES * activations,
                  config.bytes_per_position(), store_bytes(config, want + scratch))  # fmt: skip


def check_fraction(memory_fraction: float) -> None:
    """Refuse (ConfigError) a memory fraction outside (0, 1]."""
    number = isinstance(memory_fraction, (int, float)) and not isinstance(memory_fraction, bool)
    if not number or not 0 < memory_fraction <= 1:
        raise ConfigError(f"memory_fraction is {memory_fraction!r}; use a fraction in (0, 1], e.g. 0.9")


def model_capacity(model: object) -> int:
    """Positions per sequence when the caller gives none: the model's `max_positions` (e.g. a
    transformers config's max_position_embeddings) when it has one, else `DEFAULT_CAPACITY`."""
    return getattr(model, "max_positions", None) or DEFAULT_CAPACITY


def size_store(
    model,
    config: CacheConfig,
    memory_fraction: float,
    rows: int,
    agree: Callable[[int], int] = lambda n: n,
    step_tokens: int | None = None,
) -> tuple[CacheConfig, Sizing]:
    """`config` with a pool of as many positions as fit on its model's device, and the `Sizing`
    that chose them: the device's memory in use now (weights loaded, store not yet allocated) and
    the activations of one forward at `config.max_width` with `rows` logits rows are measured first.
    `agree`: under tensor parallelism, the fewest positions any rank fits (each rank's store holds
    its share of the KV heads and sizes from its own device; every rank must hold the same rows).
    `step_tokens`: max_seqs="auto" with that step budget; `config.max_seqs` then becomes
    `auto_rows` of the agreed positions (the same on every rank), and the positions at most what
    those sequences reach at full capacity."""
    device = torch.device(model.device)
    total, in_use = device_memory(device)
    activations = measure_activation_bytes(model, config, config.max_width, min(rows, config.max_width))
    chosen = plan(config, total=total, in_use=in_use, activations=activations, memory_fraction=memory_fraction)
    positions = agree(chosen.positions)
    if step_tokens is not None:
        config = replace(config, max_seqs=auto_rows(positions, config.capacity, step_tokens), max_segments=0)
        positions = min(positions, config.max_seqs * config.capacity)
    if positions != chosen.positions or step_tokens is not None:
        chosen = plan(config, total=total, in_use=in_use, activations=activations, memory_fraction=memory_fraction,
                      positions=positions)  # fmt: skip
    return replace(config, pool_rows=chosen.positions + config.scratch_rows), chosen


def device_memory(device: torch.device) -> tuple[int, int]:
    """(total, in use) bytes of `device`: CUDA from the driver, CPU from the OS (physical memory)."""
    if device.type == "cuda":
        # Blocks this process's allocator caches but no tensor holds (an engine closed or dropped
        # before this one) are free for this process: give them back first, or they count as in use.
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        return total, total - free
    try:
        page, pages, free = os.sysconf("SC_PAGE_SIZE"), os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError) as exc:
        raise ConfigError(f"cannot read this machine's memory ({exc}); give max_seqs as a number") from exc
    return page * pages, page * (pages - free)


def measure_activation_bytes(model, config: CacheConfig, width: int, rows: int) -> int:
    """Peak bytes one eager forward of `width` tokens and `rows` logits rows allocates beyond what is
    held before it (CUDA; 0 elsewhere), with a one-sequence store of `width` positions as its cache."""
    from batchkv.cache import BatchedSequenceCache

    device = torch.device(model.device)
    if device.type != "cuda":
        return 0
    probe = replace(config, max_seqs=1, capacity=width, max_write=width, max_width=width, max_segments=0, pool_rows=0)
    cache = BatchedSequenceCache(probe, device)
    seq = cache.seq_new(reach=width)
    cache.begin_step([seq] * width, width)
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


def default_buckets(max_step_tokens: int) -> tuple[int, ...]:
    """Step widths below `max_step_tokens`, then `max_step_tokens` itself.

    Powers of two to 32 and 48, 64 for decode (one graph each, two where prompt chunks are long; a
    decode step pads at most to the next), then every 64 to 512 and every 128 beyond: wide steps are
    compute bound, so their padding costs real time, and the scheduler trims prompt chunks to land on
    a width exactly.
    """
    widths = [1, 2, 4, 8, 16, 32, 48, 64, *range(128, 513, 64), *range(640, max_step_tokens, 128)]
    return (*(w for w in widths if w < max_step_tokens), max_step_tokens)
