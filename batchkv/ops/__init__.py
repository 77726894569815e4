"""Kernels over the column store, and their torch references.

- `sdpa_varlen_reference(q, k_store, v_store, seq_info, *, scale, causal, window)`: the oracle.
- `kv_write_reference(k_flat, v_flat, k, v, slots)`: the step's K/V write.
- `sdpa_varlen`, `kv_write`: the Triton kernels of the same contracts (imported lazily, so CPU-only
  use works without Triton; on CPU they run under `TRITON_INTERPRET=1`). Their modules are
  `sdpa_varlen_triton` and `kv_write_triton`: a submodule named like the function it exports
  would shadow the function on this package once imported.

`resolve_backend` / `backend_functions` pick the pair a cache uses.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from batchkv.errors import ConfigError
from batchkv.ops.reference import kv_write_reference, sdpa_varlen_reference

BACKENDS = ("auto", "triton", "reference")


def triton_available(device: torch.device) -> bool:
    """True when the Triton kernels can run on `device` (CUDA with Triton importable)."""
    if device.type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_backend(name: str, device: torch.device) -> str:
    """Turn "auto" into "triton" (CUDA with Triton) or "reference"; check explicit choices."""
    if name not in BACKENDS:
        raise ConfigError(f"attention backend {name!r} is unknown; use one of {BACKENDS}")
    if name == "auto":
        return "triton" if triton_available(device) else "reference"
    return name


def backend_functions(name: str) -> tuple[Callable[..., None], Callable[..., torch.Tensor]]:
    """(kv_write, sdpa_varlen) for a resolved backend name."""
    if name == "reference":
        return kv_write_reference, sdpa_varlen_reference
    if name == "triton":
        from batchkv.ops.kv_write_triton import kv_write
        from batchkv.ops.sdpa_varlen_triton import sdpa_varlen

        return kv_write, sdpa_varlen
    raise ConfigError(f"attention backend {name!r} is unknown; use one of {BACKENDS[1:]}")


def __getattr__(name: str) -> object:
    """Lazy `sdpa_varlen` / `kv_write` (importing Triton only when they are asked for)."""
    if name == "sdpa_varlen":
        from batchkv.ops.sdpa_varlen_triton import sdpa_varlen

        return sdpa_varlen
    if name == "kv_write":
        from batchkv.ops.kv_write_triton import kv_write

        return kv_write
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BACKENDS",
    "backend_functions",
    "kv_write",
    "kv_write_reference",
    "resolve_backend",
    "sdpa_varlen",
    "sdpa_varlen_reference",
    "triton_available",
]
