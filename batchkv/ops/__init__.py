"""Kernels over the column store, and their torch references.

- `sdpa_varlen_reference(q, k_store, v_store, seq_info, *, scale, causal, window)`: the oracle.
- `kv_write_reference(k_flat, v_flat, k, v, slots)`: the step's K/V write.
- `sdpa_varlen`, `kv_write`: the Triton kernels of the same contracts (imported lazily, so CPU-only
  use works without Triton; on CPU they run under `TRITON_INTERPRET=1`). Their modules are
  `sdpa.launch` (the subpackage `batchkv.ops.sdpa` holds the attention kernel's host side, its
  device code and its configuration) and `kv_write_triton`: a submodule named like the function it
  exports would shadow the function on this package once imported.

`resolve_backend` / `backend_functions` pick the pair a cache uses. `batchkv.ops.support.refusal`
is the one owner of the rule on which head_dim and storage dtype each backend takes (every
validator, from the cache to `batchkv export`, asks it; `kernel_problem` is its Triton question).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from batchkv.errors import ConfigError, DependencyError
from batchkv.ops.reference import kv_write_reference, sdpa_varlen_reference
from batchkv.ops.support import refusal

BACKENDS = ("auto", "triton", "reference")


def kernel_problem(head_dim: int, dtype: torch.dtype | None = None) -> str | None:
    """Why the Triton kernels cannot run K/V of this head_dim stored as `dtype` (default bf16), or
    None if they can. The rule itself is `batchkv.ops.support.refusal`'s; the torch reference
    backend takes any head_dim."""
    return refusal(torch.bfloat16 if dtype is None else dtype, head_dim, "triton")


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
        try:
            from batchkv.ops.kv_write_triton import kv_write
            from batchkv.ops.sdpa.launch import sdpa_varlen
        except ImportError as exc:
            raise DependencyError(
                f"attention 'triton' needs Triton ({exc}); pip install 'batchkv[triton]', or use attention='reference'"
            ) from exc
        return kv_write, sdpa_varlen
    raise ConfigError(f"attention backend {name!r} is unknown; use one of {BACKENDS[1:]}")


def __getattr__(name: str) -> object:
    """Lazy `sdpa_varlen` / `kv_write` (importing Triton only when they are asked for)."""
    if name == "sdpa_varlen":
        from batchkv.ops.sdpa.launch import sdpa_varlen

        return sdpa_varlen
    if name == "kv_write":
        from batchkv.ops.kv_write_triton import kv_write

        return kv_write
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BACKENDS",
    "backend_functions",
    "kernel_problem",
    "kv_write",
    "kv_write_reference",
    "resolve_backend",
    "sdpa_varlen",
    "sdpa_varlen_reference",
    "triton_available",
]
