"""K/V dtype names: the one mapping between the names manifests and the CLI use and torch dtypes.

A model's K/V come in one of `MODEL_DTYPES` (a manifest's `dtype`, `--dtype`); the store may keep
them in any of `STORAGE_DTYPES`, which adds e4m3 (a manifest's `kv_dtype`, `--kv-dtype`).
"""

from __future__ import annotations

import torch

from batchkv.errors import ConfigError

MODEL_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}
STORAGE_DTYPES: dict[str, torch.dtype] = {**MODEL_DTYPES, "float8_e4m3fn": torch.float8_e4m3fn}


def dtype_named(name: str) -> torch.dtype:
    """The torch dtype of a K/V dtype name ("bfloat16" -> torch.bfloat16, "float8_e4m3fn" -> e4m3)."""
    if name not in STORAGE_DTYPES:
        raise ConfigError(f"dtype {name!r} is not a K/V dtype; use one of {', '.join(STORAGE_DTYPES)}")
    return STORAGE_DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """The name of a K/V torch dtype (torch.bfloat16 -> "bfloat16")."""
    for name, candidate in STORAGE_DTYPES.items():
        if candidate == dtype:
            return name
    raise ConfigError(f"dtype {dtype} has no K/V dtype name; use one of {', '.join(STORAGE_DTYPES)}")


def dtype_bytes(name: str) -> int:
    """Bytes of one element of a K/V dtype name."""
    return dtype_named(name).itemsize
