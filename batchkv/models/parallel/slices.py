"""Read slices of safetensors tensors with `os.pread`, so a rank reads only its share from disk.

A safetensors file is an 8-byte little-endian header length, a JSON header mapping each name to
its dtype, shape and byte range, then the data, row-major. A rank's share of a weight is a range
of rows (column-parallel weights, the vocab-parallel embedding and LM head: one contiguous read) or
a range of columns (row-parallel weights: one read per row of the range's bytes). Nothing is
mapped, so the bytes read are exactly what the kernel's read counters (`/proc/self/io` rchar)
see: the headers and the slices, never a whole tensor a rank does not hold.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import torch

from batchkv.errors import CheckpointError

DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
          "I64": torch.int64, "I32": torch.int32, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
          "F8_E4M3": torch.float8_e4m3fn}  # fmt: skip
MAX_HEADER = 100 * 2**20  # bytes: safetensors' own limit


class SafetensorsSlices:
    """The tensors of a safetensors file or a folder of them, read by rows or by columns.

    >>> with SafetensorsSlices("model_dir") as ckpt:
    ...     q = ckpt.read("model.layers.0.self_attn.q_proj.weight", 0, range(0, 1024))   # rows
    ...     o = ckpt.read("model.layers.0.self_attn.o_proj.weight", 1, range(0, 2048))   # columns
    """

    def __init__(self, path: str | os.PathLike) -> None:
        path = Path(path)
        files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
        if not files or not all(f.is_file() for f in files):
            raise CheckpointError(f"no safetensors checkpoint at {path} (give a .safetensors file or a folder of them)")
        self._fds: list[int] = []
        self.entries: dict[str, tuple[int, torch.dtype, tuple[int, ...], int]] = {}  # name -> fd, dtype, shape, offset
        try:
            for file in files:
                self._index(file)
        except BaseException:
            self.close()
            raise

    def _index(self, file: Path) -> None:
        fd = os.open(file, os.O_RDONLY)
        self._fds.append(fd)
        raw = os.pread(fd, 8, 0)
        size = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
        if not 0 < size <= MAX_HEADER:
            raise CheckpointError(f"{file} is not a safetensors file (header length {size})")
        try:
            header = json.loads(os.pread(fd, size, 8))
        except ValueError as exc:
            raise CheckpointError(f"{file} is not a safetensors file: its header is not JSON ({exc})") from exc
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if info.get("dtype") not in DTYPES:
                raise CheckpointError(f"{file}: tensor {name} has dtype {info.get('dtype')!r}, which is not read here")
            self.entries[name] = (fd, DTYPES[info["dtype"]], tuple(info["shape"]), 8 + size + info["data_offsets"][0])

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name][2]

    def read(self, name: str, dim: int | None = None, span: range | None = None) -> torch.Tensor:
        """Tensor `name`, or (dim 0) its rows `span`, or (dim 1 of a 2-D tensor) its columns `span`."""
        fd, dtype, shape, offset = self.entries[name]
        item = torch.empty((), dtype=dtype).element_size()
        if dim is None or span is None:
            dim, span = 0, range(shape[0] if shape else 1)
        rest = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
        if dim == 0:
            out_shape = (len(span), *shape[1:]) if shape else ()
            buf = bytearray(len(span) * rest * item)
            self._pread(fd, memoryview(buf), offset + span.start * rest * item)
        elif dim == 1 and len(shape) == 2:
            out_shape = (shape[0], len(span))
            row, width = shape[1] * item, len(span) * item
            buf = bytearray(shape[0] * width)
            view = memoryview(buf)
            for r in range(shape[0]):
                self._pread(fd, view[r * width : (r + 1) * width], offset + r * row + span.start * item)
        else:
            raise CheckpointError(f"{name}: cannot slice dim {dim} of a tensor of shape {shape}")
        return torch.frombuffer(buf, dtype=dtype).reshape(out_shape) if buf else torch.empty(out_shape, dtype=dtype)

    @staticmethod
    def _pread(fd: int, into: memoryview, offset: int) -> None:
        done = 0
        while done < len(into):  # a read may return less (Linux caps one at 2 GiB)
            n = os.preadv(fd, [into[done:]], offset + done)
            if n <= 0:
                raise CheckpointError(f"a safetensors file ends early: wanted {len(into)} bytes at {offset}")
            done += n

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []

    def __enter__(self) -> SafetensorsSlices:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
