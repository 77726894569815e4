"""Pinned host staging: one host buffer per dtype, mirrored by a fixed-address device buffer.

A step's small inputs (positions, write slots, `seq_info`; token ids, RoPE indexes, sampling
parameters) are written on the host and cross with one host-to-device copy per dtype. On CUDA the
host side is pinned and the copy asynchronous, so the host buffer may be rewritten only once the
previous copy ran: `begin` waits for it, `upload` copies and records when it ran. The device
buffers are only ever written by `copy_`, so their addresses never change and a captured graph
that reads them stays valid.
"""

from __future__ import annotations

import numpy as np
import torch


class Staging:
    """Host and device buffers of `sizes[dtype]` elements each, zero-filled, on `device`."""

    def __init__(self, sizes: dict[torch.dtype, int], device: torch.device) -> None:
        pin = device.type == "cuda"
        self._host = {dtype: torch.zeros(n, dtype=dtype, pin_memory=pin) for dtype, n in sizes.items()}
        self.device_buffers = {dtype: torch.zeros_like(h, device=device) for dtype, h in self._host.items()}
        self._copied = torch.cuda.Event() if pin else None
        self._device = device
        self._views = {dtype: h.numpy() for dtype, h in self._host.items()}  # the host buffers never move
        # On the CPU the "device" buffers are host memory too: a copy is a NumPy slice assignment
        # (the same bytes, about a fifth of a torch slice and copy_'s fixed cost per call).
        self._device_views = (
            {dtype: d.numpy() for dtype, d in self.device_buffers.items()} if device.type == "cpu" else None
        )

    @staticmethod
    def nbytes(sizes: dict[torch.dtype, int]) -> int:
        """Bytes of host plus device buffers for `sizes` (what construction allocates)."""
        return 2 * sum(n * torch.empty((), dtype=dtype).element_size() for dtype, n in sizes.items())

    def begin(self) -> dict[torch.dtype, np.ndarray]:
        """Wait until the previous upload has left the host buffers; numpy views of them to write."""
        if self._copied is not None:
            self._copied.synchronize()
        return dict(self._views)

    def peek(self) -> dict[torch.dtype, np.ndarray]:
        """Numpy views of the host buffers, to read what was staged (no wait: nothing is written)."""
        return dict(self._views)

    def upload(self, spans: dict[torch.dtype, list[tuple[int, int]]] | None = None) -> int:
        """Copy the host buffers to their device buffers (asynchronous from pinned memory on CUDA);
        returns the elements copied.

        spans: per dtype, the [start, stop) element ranges to copy (adjacent ones merged into one
        copy; a dtype left out is not copied); None: every buffer whole.
        """
        if self._device_views is not None:
            return self._upload_cpu(spans)
        non_blocking = self._copied is not None
        copied = 0
        for dtype, host in self._host.items():
            device = self.device_buffers[dtype]
            if spans is None:
                device.copy_(host, non_blocking=non_blocking)
                copied += host.numel()
                continue
            for start, stop in _merged(spans.get(dtype, ())):
                device[start:stop].copy_(host[start:stop], non_blocking=non_blocking)
                copied += stop - start
        if self._copied is not None:  # on the stream the copies ran on: the device's current one
            self._copied.record(torch.cuda.current_stream(self._device))
        return copied

    def _upload_cpu(self, spans: dict[torch.dtype, list[tuple[int, int]]] | None) -> int:
        """`upload` on the CPU: the same spans copied between NumPy views of the two buffers."""
        copied = 0
        for dtype, host in self._views.items():
            device = self._device_views[dtype]  # type: ignore[index]
            if spans is None:
                device[:] = host
                copied += host.size
                continue
            for start, stop in _merged(spans.get(dtype, ())):
                device[start:stop] = host[start:stop]
                copied += stop - start
        return copied


def _merged(spans) -> list[tuple[int, int]]:
    """Non-empty [start, stop) ranges in order, those that touch or overlap merged."""
    out: list[tuple[int, int]] = []
    for start, stop in sorted(spans):
        if stop <= start:
            continue
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], stop))
        else:
            out.append((start, stop))
    return out


class NamedStaging(Staging):
    """`Staging` carved once into named slices (STYLE 18): `layout` maps each name to (dtype, elements),
    laid out one after another within its dtype's buffer. `buf[name]` is the device slice a graph
    reads; `begin_named()` waits like `begin` and returns the host slices by name."""

    def __init__(self, layout: dict[str, tuple[torch.dtype, int]], device: torch.device) -> None:
        sizes: dict[torch.dtype, int] = {}
        for dtype, n in layout.values():
            sizes[dtype] = sizes.get(dtype, 0) + n
        super().__init__(sizes, device)
        self.layout = layout
        self.buf: dict[str, torch.Tensor] = self._carve(self.device_buffers)
        self._named: dict[str, np.ndarray] = self._carve({d: h.numpy() for d, h in self._host.items()})

    def _carve(self, buffers: dict) -> dict:
        offsets: dict[torch.dtype, int] = dict.fromkeys(buffers, 0)
        out = {}
        for name, (dtype, n) in self.layout.items():
            out[name] = buffers[dtype][offsets[dtype] : offsets[dtype] + n]
            offsets[dtype] += n
        return out

    def begin_named(self) -> dict[str, np.ndarray]:
        """`begin`, then the host slices by name."""
        self.begin()
        return self._named
