"""The cases of bench/kernel_bench.py: geometry, lengths, rotated seq_info tables, and the reference.

Full geometry: SenseNova decode shapes (Hq 32, Hkv 8, D 128, bf16), a 65-column store of 16384
rows (the b1-l16384 case fits), a 128-row seq_info (the cache's default max_segments for 64
sequences), random distinct columns, seed 0. `--small` shrinks everything for a CPU smoke run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from batchkv.ops import sdpa_varlen_reference
from batchkv.ops.reference import quantize_fp8
from batchkv.ops.sdpa.launch import SdpaConfig, sdpa_varlen
from batchkv.ops.support import empty_scales


@dataclass(frozen=True)
class Geometry:
    hq: int
    hkv: int
    d: int
    rows: int
    columns: int  # max_seqs + 1 (the last is the scratch column)
    segments: int  # seq_info rows
    dtype: torch.dtype
    device: str
    mixed: tuple[int, int]  # mixed cases draw kv_end uniformly from this range
    most_calls: int  # calls per timed graph, and data rotations, at most

    @property
    def g(self) -> int:
        return self.hq // self.hkv

    def kv_bytes(self, positions: int) -> int:
        """Bytes of K and V of `positions` positions."""
        return positions * self.hkv * self.d * 2 * self.dtype.itemsize


FULL = Geometry(32, 8, 128, 16384, 65, 128, torch.bfloat16, "cuda", (64, 8192), 64)
SMALL = Geometry(8, 2, 32, 320, 9, 16, torch.float32, "cpu", (8, 300), 1)

# name: (batch, q_len, kv_end of each sequence, or None for the geometry's mixed range)
CASES = {
    "b1-l1024": (1, 1, [1024]),
    "b1-l4096": (1, 1, [4096]),
    "b1-l9100": (1, 1, [9100]),
    "b8-mixed": (8, 1, None),
    "b32-mixed": (32, 1, None),
    "b64-mixed": (64, 1, None),
    "b32-verify4": (32, 4, None),
    "prefill-4x512": (4, 512, [1536] * 4),  # 512 new tokens after 1024-token histories
    "prefill-1x2048": (1, 2048, [2048]),
    # added last, so the cases above keep the lengths and columns of earlier runs (same seed)
    "b1-l16384": (1, 1, [16384]),
    "b64-l512": (64, 1, [512] * 64),  # short histories: launch and prologue cost dominate
}
# cases run only when named (full geometry): `SdpaConfig.narrow`'s few-token steps, and the serving
# benchmark's histories and prompt chunks (bench/kv_fp8.py's, before `--e4m3`); (lo, hi): kv_end U[lo, hi]
EXTRA_CASES = {
    "b2-l4096": (2, 1, [4096] * 2),
    "b4-mixed": (4, 1, None),
    "b16-mixed": (16, 1, None),
    "b1-verify16": (1, 16, [4096]),  # one 16-token draft block verified
    "b64-serve": (64, 1, (64, 3072)),  # prompt U[64, 2048] + output U[64, 1024]
    "prefill-2x512": (2, 512, [2048, 1536]),  # two 512-token prompt chunks, as a serving step's
}
SMALL_CASES = {
    "b1-l200": (1, 1, [200]),
    "b4-mixed": (4, 1, None),
    "b8-l40": (8, 1, [40] * 8),
    "b4-verify4": (4, 4, None),
    "prefill-2x32": (2, 32, [48, 48]),
    "prefill-1x64": (1, 64, [64]),
}


class Case:
    """One case: lengths, R rotated column sets with their seq_info tables, and the packed q.

    Calls rotate over R copies of their data (other columns for batchkv, other gathered buffers for
    the peers) so that a case smaller than the L2 cache is still read from HBM.
    """

    def __init__(self, name: str, batch: int, q_len: int, lengths, geo: Geometry, l2_bytes: int, gen) -> None:
        self.name, self.batch, self.q_len, self.geo = name, batch, q_len, geo
        lo, hi = lengths if isinstance(lengths, tuple) else geo.mixed
        if isinstance(lengths, list):
            self.lengths = lengths
        else:
            self.lengths = torch.randint(lo, hi + 1, (batch,), generator=gen).tolist()
        self.bytes = geo.kv_bytes(sum(self.lengths))  # K and V of the valid prefixes
        # causal (query, key) pairs: query i of a segment attends kv_end - q_len + i + 1 keys
        pairs = sum(q_len * (n - q_len) + q_len * (q_len + 1) // 2 for n in self.lengths)
        self.flops = 4 * geo.d * geo.hq * pairs
        self.rot = min(geo.most_calls, max(1, math.ceil(4 * l2_bytes / self.bytes)))
        est_us = max(self.bytes / 3e6, self.flops / 3e8) + 5
        self.calls = max(self.rot, min(geo.most_calls, math.ceil(200 / est_us)))
        seqs = geo.columns - 1
        perm = torch.randperm(seqs, generator=gen).tolist()  # rotation j takes the next `batch` columns
        self.cols = [[perm[(j * batch + b) % seqs] for b in range(batch)] for j in range(self.rot)]
        self.tables = [self._table(cols) for cols in self.cols]
        self.q = torch.randn(batch * q_len, geo.hq, geo.d, generator=gen).to(geo.device, geo.dtype)
        self._reference: dict[torch.dtype, torch.Tensor] = {}

    def _table(self, cols: list[int]) -> torch.Tensor:
        info = torch.zeros(self.geo.segments, 4, dtype=torch.int32)
        for b, (col, kv_end) in enumerate(zip(cols, self.lengths, strict=True)):
            info[b] = torch.tensor([b * self.q_len, self.q_len, col, kv_end])
        return info.to(self.geo.device)

    def reference(self, k: torch.Tensor, v: torch.Tensor, **scales) -> torch.Tensor:
        """The torch reference on rotation 0, fp32 [T, Hq, D] (computed once per store dtype; an e4m3
        store passes its `k_scale` and `v_scale`)."""
        if k.dtype not in self._reference:
            self._reference[k.dtype] = sdpa_varlen_reference(self.q, k, v, self.tables[0], **scales).float()
        return self._reference[k.dtype]

    def error(self, out: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **scales) -> float:
        """Max abs difference of `out` (rotation 0, [T, Hq, D]) from the reference."""
        return float((out.float() - self.reference(k, v, **scales)).abs().max())


def build_cases(names: list[str], small: bool, l2_bytes: int) -> tuple[Geometry, dict[str, Case]]:
    """The geometry and the named cases (seed 0), in the order given."""
    geo, table = (SMALL, SMALL_CASES) if small else (FULL, CASES | EXTRA_CASES)
    gen = torch.Generator().manual_seed(0)
    return geo, {n: Case(n, *table[n], geo, l2_bytes, gen) for n in names}


def e4m3_store(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A store x [rows, C, Hkv, D] as e4m3 codes and fp32 scales [rows, C, Hkv] in the cache's layout,
    quantised 1,024 rows at a time (the whole store's fp32 copy would not fit beside it)."""
    codes = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scales = empty_scales(*x.shape[:3], device=x.device)  # the store's layout: [C, Hkv, rows] storage
    for r in range(0, x.shape[0], 1024):
        codes[r : r + 1024], scales[r : r + 1024] = quantize_fp8(x[r : r + 1024])
    return codes, scales


TOLERANCE = 3e-2  # max abs error against the reference (bf16 outputs of unit-variance values)


def batchkv_calls(case: Case, k, v, config: SdpaConfig | None, **scales) -> list:
    """sdpa_varlen on rotation j of `case` for each of its calls, into one output buffer (an e4m3
    store passes its `k_scale` and `v_scale`)."""
    out = torch.empty_like(case.q)
    return [
        lambda j=j: sdpa_varlen(case.q, k, v, case.tables[j % case.rot], out=out, config=config, **scales)
        for j in range(case.calls)
    ]
