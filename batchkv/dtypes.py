"""K/V storage dtype names: the one mapping between the names manifests and the CLI use and torch dtypes."""

from __future__ import annotations

import torch

from batchkv.errors import ConfigError

STORAGE_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}


def dtype_named(name: str) -> torch.dtype:
    """The torch dtype of a storage dtype name ("bfloat16" -> torch.bfloat16)."""
    if name not in STORAGE_DTYPES:
        raise ConfigError(f"dtype {name!r} is not a storage dtype; use one of {', '.join(STORAGE_DTYPES)}")
    return STORAGE_DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """The storage dtype name of a torch dtype (torch.bfloat16 -> "bfloat16")."""
    for name, candidate in STORAGE_DTYPES.items():
        if candidate == dtype:
            return name
    raise ConfigError(f"dtype {dtype} has no storage dtype name; use one of {', '.join(STORAGE_DTYPES)}")


def dtype_bytes(name: str) -> int:
    """Bytes of one element of a storage dtype name."""
    return dtype_named(name).itemsize
