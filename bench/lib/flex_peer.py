"""flex_attention as a peer of sdpa_varlen: compiled per case shape, at its best knobs.

Each candidate starts from a dynamo reset and `torch.compile(flex_attention, dynamic=False)`, so
every case compiles for its own static batch: inductor's flex-decoding kernel (split KV, one
program per KV head and query group) needs a static batch and is only chosen for short queries;
a compile shared across batch sizes goes symbolic and falls back to the generic flex kernel. The
block mask (length mask over K/V padded to a multiple of 128) is built outside timing; calls are
graph-replayed like batchkv's.

Knobs (`kernel_options`, read by torch 2.11 and 2.13 alike): what the mask guarantees (rows never
empty, contiguous blocks) and a prescaled q; for decode shapes the split count (`SPLIT_KV`, default
2 * SMs / (B * Hkv)), key tile (`BLOCK_N`), warps and pipeline stages; for prefill shapes the
generic kernel's tiles. The first call runs under `run_and_get_code`, so the
record says which template inductor generated (flex decoding has `SPLIT_KV`) and its constants
(read, not forced: torch 2.11 may lack `kernel_options["BACKEND"]`).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import torch

from .kernel_cases import Case
from .kernel_peers import Candidate, gather

# Facts of a length mask that flex may exploit: every query row sees key 0, and each row's blocks
# are a contiguous prefix. PRESCALE_QK folds the scale into q first (checked against the reference).
MASK_FACTS = {"ROWS_GUARANTEED_SAFE": True, "BLOCKS_ARE_CONTIGUOUS": True, "PRESCALE_QK": True}
PREFILL_KNOBS = [{}, MASK_FACTS, {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}]


def decode_knobs(case: Case) -> list[dict]:
    """Knob sets for a short-query case, the default first, then in order of promise."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 8
    split = max(1, sms // (case.batch * case.geo.hkv) * 2)  # torch's default (get_split_k)
    return [
        {},
        MASK_FACTS,
        {"num_stages": 3},  # the first of inductor's own autotuning list (BLOCK_N 64, 3 stages, 2 warps)
        {"SPLIT_KV": 2 * split},
        {"BLOCK_N": 128, "num_warps": 4, "num_stages": 3},
        {"SPLIT_KV": 4 * split, "num_stages": 3},
    ]


def knob_sets(case: Case) -> list[dict]:
    return decode_knobs(case) if case.q_len * case.geo.g < 128 else PREFILL_KNOBS


class FlexData:
    """q [B, Hq, q_len, D], R rotations of K/V padded to a multiple of 128, and the block mask."""

    def __init__(self, case: Case, k: torch.Tensor, v: torch.Tensor) -> None:
        from torch.nn.attention.flex_attention import create_block_mask

        geo, q_len = case.geo, case.q_len
        self.width = -(-max(case.lengths) // 128) * 128
        self.kv = []
        for cols in case.cols:
            pairs = list(zip(cols, case.lengths, strict=True))
            self.kv.append((torch.stack([gather(k, c, n, self.width) for c, n in pairs]),
                            torch.stack([gather(v, c, n, self.width) for c, n in pairs])))  # fmt: skip
        self.q = case.q.view(case.batch, q_len, geo.hq, geo.d).transpose(1, 2).contiguous()
        lens = torch.tensor(case.lengths, device=geo.device)

        def mask_mod(b, h, q_idx, kv_idx):
            return kv_idx <= lens[b] - q_len + q_idx

        self.block_mask = create_block_mask(mask_mod, case.batch, None, q_len, self.width, device=geo.device)


def _generated(codes: list[str]) -> dict:
    """Which flex template inductor generated, and its launch constants, from the output code."""
    text = "\n".join(codes)
    if "flex" not in text and "SPARSE_KV_BLOCK_SIZE" not in text:
        return {"path": "unknown (no generated code was captured)"}
    found = {"path": "flex_decoding" if "SPLIT_KV" in text else "flex_attention"}
    for name in ("SPLIT_KV", "BLOCK_M", "BLOCK_N", "SPARSE_KV_BLOCK_SIZE"):
        match = re.search(rf"\b{name} ?: ?tl\.constexpr ?= ?(\d+)", text)
        if match:
            found[name] = int(match.group(1))
    for name in ("num_warps", "num_stages"):
        match = re.search(rf"\b{name}=(\d+)", text)
        if match:
            found[name] = int(match.group(1))
    return found


def flex(case: Case, k: torch.Tensor, v: torch.Tensor, knobs: list[dict] | None = None) -> Iterator[Candidate]:
    """One candidate per knob set; each compiles fresh (dynamo reset, dynamic=False) on first use."""
    from torch._inductor.utils import run_and_get_code
    from torch.nn.attention.flex_attention import flex_attention

    data = FlexData(case, k, v)
    torch._inductor.config.fx_graph_cache = False  # a cache hit would skip the code the record reads
    for options in knobs if knobs is not None else knob_sets(case):
        torch._dynamo.reset()
        compiled = torch.compile(flex_attention, dynamic=False)

        def call(j, compiled=compiled, options=options):
            kk, vv = data.kv[j % case.rot]
            return compiled(data.q, kk, vv, block_mask=data.block_mask, enable_gqa=True, kernel_options=options)

        start = time.perf_counter()
        _, codes = run_and_get_code(call, 0)  # the compile (resets dynamo, so it happens here)
        config = {"kernel_options": options, "compile_s": round(time.perf_counter() - start, 1)}
        config.update(_generated(codes))

        def output(call=call):
            return call(0).transpose(1, 2).reshape(-1, case.geo.hq, case.geo.d)

        yield Candidate(config, [lambda j=j, call=call: call(j) for j in range(case.calls)], output)
