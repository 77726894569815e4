"""What a cache costs before any sequence exists, and the refusal of a geometry the memory there
cannot serve: `static_bytes(config)` (also `BatchedSequenceCache.static_bytes`) and
`check_static(config, device)`, asked by the cache's constructor before it allocates anything."""

from __future__ import annotations

import os

import torch

from batchkv.cache.config import CacheConfig
from batchkv.cache.staging import Staging
from batchkv.cache.step import StepBuffers
from batchkv.errors import CapacityError


def available_host_memory() -> int | None:
    """Bytes of host memory available to allocate now (Linux's MemAvailable, else the free pages);
    None when the OS does not say."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def static_bytes(config: CacheConfig) -> tuple[int, int]:
    """(host, device) bytes a cache of `config` holds whatever it stores, sized by `max_seqs`,
    `max_segments` and `max_width`: the per-sequence arrays (id state and each layer group's
    extent mirror) and the step buffers (a pinned host copy and the device one). The K/V pool
    comes on top (it grows with what sequences reach, or is `pool_rows` whole)."""
    groups = len({config.ring_rows(layer) for layer in range(config.num_layers)})
    per_sequence = 2 + 3 * 8 + groups * 2 * 8  # held, declared; length, high water, height; base, rows
    staged = Staging.nbytes(StepBuffers.sizes(config.max_width, groups, config.max_segments)) // 2
    return config.max_seqs * per_sequence + staged, staged


def check_static(config: CacheConfig, device: torch.device) -> None:
    """Refuse at once (CapacityError naming the bytes) a `max_seqs` the memory there is cannot
    serve: its fixed buffers (`static_bytes`) and, for a store that grows on demand, one K/V
    position per sequence (fewer could never hold max_seqs sequences; a `pool_rows` store is
    allocated whole next, under its own check). Rather than allocate for minutes, or accept a
    geometry that fails later."""
    host, on_device = static_bytes(config)
    kv = 0 if config.pool_rows else config.max_seqs * config.bytes_per_position()
    if device.type == "cuda":  # (place, its fixed buffers, K/V, bytes available there)
        places = [("the host", host, 0, available_host_memory())]
        places.append((str(device), on_device, kv, torch.cuda.mem_get_info(device)[0]))
    else:
        places = [("the host", host + on_device, kv, available_host_memory())]
    for where, fixed, least, free in places:
        need = fixed + least
        if free is not None and need > free:
            raise CapacityError(
                f"max_seqs={config.max_seqs} needs {need} bytes ({need / 2**30:.2f} GiB) on {where} before any "
                f"sequence exists ({fixed} for its per-sequence state and step buffers, {least} for one K/V "
                f"position per sequence) and {free} bytes are available; lower max_seqs"
            )
