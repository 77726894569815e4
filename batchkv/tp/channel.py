"""Rank 0's step plans to the other ranks: one broadcast over the gloo `plans` group per plan.

A plan (a picklable object; None means stop) travels in a fixed CHUNK-byte buffer, its length in
the first 8 bytes. A plan larger than the buffer (a step with long prompt chunks) sends the rest in
a second broadcast of exactly that many bytes, so decode steps cost one small broadcast and a
prefill step two. The ranks are this engine's own processes: pickle is safe between them.
"""

from __future__ import annotations

import pickle
import struct

import torch
import torch.distributed as dist

CHUNK = 16384  # bytes a plan's first broadcast carries (its length included)
_HEAD = struct.Struct("<q")


class PlanChannel:
    """`send` on rank 0, `recv` on the others, over the process group `group`."""

    def __init__(self, group: object) -> None:
        self.group = group
        self._buf = torch.zeros(CHUNK, dtype=torch.uint8)
        self.sent_bytes = 0  # plan bytes sent so far (rank 0)
        self.broadcasts = 0

    def send(self, plan: object) -> None:
        data = pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL)
        first = min(len(data), CHUNK - _HEAD.size)
        view = self._buf.numpy()
        view[: _HEAD.size] = memoryview(_HEAD.pack(len(data)))
        view[_HEAD.size : _HEAD.size + first] = memoryview(data)[:first]
        dist.broadcast(self._buf, 0, group=self.group)
        if first < len(data):
            dist.broadcast(torch.frombuffer(bytearray(data[first:]), dtype=torch.uint8), 0, group=self.group)
        self.sent_bytes += len(data)
        self.broadcasts += 1 + (first < len(data))

    def recv(self) -> object:
        dist.broadcast(self._buf, 0, group=self.group)
        view = self._buf.numpy()
        (size,) = _HEAD.unpack(view[: _HEAD.size].tobytes())
        first = min(size, CHUNK - _HEAD.size)
        data = view[_HEAD.size : _HEAD.size + first].tobytes()
        if first < size:
            rest = torch.empty(size - first, dtype=torch.uint8)
            dist.broadcast(rest, 0, group=self.group)
            data += rest.numpy().tobytes()
        return pickle.loads(data)
