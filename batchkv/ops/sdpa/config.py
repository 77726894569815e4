"""`SdpaConfig`: the launch choices of `sdpa_varlen`, and `resolve_config`, which fills them from shapes.

Choices come from a static heuristic (no triton.autotune, whose first-call benchmarking does not
mix with graph capture); bench/results/README.md records the sweeps that chose them.
Everything here is host-side and reads no device memory.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch

from batchkv.errors import ContractError
from batchkv.ops.support import sm_count

REGISTERS = 65536  # 32-bit registers per SM (every CUDA GPU since sm_50)


@dataclass(frozen=True)
class SdpaConfig:
    """Launch choices; a 0 field is filled by `resolve_config` from shapes and the device.

    Split path: heads: KV heads per program (a power of two; 0 means 1: on the H200 one head
    per program beat 2, 4 and 8 on every decode, verify and mixed case, see
    bench/results/kernels-sweep-h200.json). Several heads make 3-D tiles with one warp per head:
    num_warps 0 means 4 for one head, else `heads`, since Triton 3.6 puts every warp on the
    head axis and replicates work when there are more warps than heads. Small heads (one head per
    program, head tiles of at most 64 columns, no warp_split, not split_merge) take 0 as 2 warps,
    occupancy 4 and 2 stages: on the H200 at SmolLM2-135M's attention (Hq 9, Hkv 3, D 64; 16-256
    decoding sequences of serving lengths) that ran 1.01-1.15x faster on bf16 stores and
    1.11-1.20x on e4m3 than 4 warps, occupancy 2 and 3 stages on a 257-column store, and served the SmolLM2
    shape from the engine's pool store no faster and no slower (bench/results/smol-attn-h200.json);
    block_n: key positions per tile (0: ~32 KiB of K+V per stage, so 128 keys of e4m3 at D 128
    where bf16 takes 64); block_m: tile rows per KV head,
    (query, group head) pairs (>= 16); q_short: segments with q_len <= q_short take this path;
    programs: programs per head group (P; 0: occupancy programs per SM over all head groups;
    occupancy 0: 2, or 4 for small heads); num_stages (0: 3, or 2 for small heads);
    min_blocks: fewest key blocks a program takes (fewer programs share a short total, fewer
    partials to merge); skip_masks: no mask on key blocks every row attends whole; merge_rows:
    tile rows per head merged at once (0: next power of two >= G); merge_tile: fp32 elements a
    merge round loads (sets how many programs' partials one round trip brings); merge_stages: > 1
    software-pipelines the merge's rounds (the next partials load while one combines);
    max_regs: register cap per thread (0: what `occupancy` programs per SM need, else none).
    Few-row variants (defaults off; bench/b1_sweep.py times them): warp_split: key sub-tiles per
    tile, one per warp, each with its own softmax state, merged once per piece (a power of two,
    one head per program, block_n / warp_split >= 16; num_warps 0 means warp_split and block_n 0
    at least 16 * warp_split; meant for 16-bit and e4m3 stores with D <= 128: fp32 tiles and D 256
    spill registers on sm_90; `warp_split.py`); prefetch: key blocks each program
    asks the L2 for ahead of its loads, the first ones before q is read (0: none).
    split_merge: steps of at most q_short tokens with T * G <= 64 (32 on e4m3) take the two-launch
    split-KV variant (`splitkv.py`: `programs` equal runs of every live segment's
    keys, then a merge launch; one head per program, no warp_split or prefetch); meant as a
    `narrow` config. pdl: the attention's launches (the split and long kernels, split_merge's two) are
    programmatic dependent launches (NVIDIA sm_90+ only; elsewhere ignored): each may start while the
    grid before it runs, plans from the table, and waits on the device for that grid's results before
    it reads q or K/V or writes, so launch latency and the plan overlap work (the K/V write, the partials).
    fuse_write: a split_merge step given `write` rows stores them in its partials kernel (each
    program writes its head's rows, then reads) instead of a `kv_write` launch first.
    table_chunk: when the call names its live rows (`sdpa_varlen(live=)`) and the table is longer than
    this, the split and long kernels plan over the live rows alone: as a table_chunk-row table when they
    fit, else in the whole table's shape masked at their count (a power of two >= 16; 0, the default:
    the whole table. On an H100 the plan served 1.008x but its kernels ran 10-15% slower on mixed
    tables, bench/results/live-oneload-h100.json).
    narrow: the config of steps of at most narrow_width packed tokens, or over a table of at most
    narrow_segments rows (T and S are static shapes, so a captured graph keeps one config), e.g. a
    few-row variant for one decoding sequence beside the batch config; None: this one.
    Long path (*_long): tile rows (0: 128 when a key row is <= 256 bytes, else 64), keys (0: 64,
    else 32), warps (0: 8), stages (0: 3, else 2); on e4m3 stores with 16-bit queries and key rows
    of <= 128 codes 0 means 64 rows, 128 keys, 4 warps, 2 stages. e4m3_qk_long (the
    default's): on e4m3 stores with 16-bit queries, D >= 32 and a positive scale, the long path
    quantises q to e4m3 (one scale per (query, head) row, amax / 448, as the write scales K) and
    runs QK^T as an e4m3 tensor-core dot on K's codes as loaded (no conversion, no trip through
    registers); PV stays an fp16 dot.
    Scores then carry q's rounding (~2^-5 RMS per element, see docs/design.md); elsewhere ignored.
    tma_long: the long path's unmasked key blocks load K and V by TMA (sm_90+ and the interpreter;
    stores whose (C, Hkv, D) part is contiguous and 16-byte aligned, elsewhere pointer loads); None:
    on for e4m3 stores with 16-bit queries. On the H200 (bench/results/long-path-h200.json) those
    tiles with TMA take e4m3 prompt chunks 1.13-1.20x faster than the 16-bit tiles with QK^T an
    e4m3 dot (155.0 against 174.5 us on four 512-token chunks) and 1.21-1.24x with exact queries;
    TMA adds 3-4% there and nothing on bf16 stores (107.6 against 109.3 us on one 2,048 prompt).
    """

    heads: int = 0
    block_n: int = 0
    block_m: int = 16
    q_short: int = 16
    programs: int = 0
    occupancy: int = 0
    num_warps: int = 0
    num_stages: int = 0
    min_blocks: int = 1
    skip_masks: bool = True
    merge_rows: int = 0
    merge_tile: int = 8192
    max_regs: int = 0
    merge_stages: int = 1
    warp_split: int = 1
    prefetch: int = 0
    split_merge: bool = False
    pdl: bool = True
    fuse_write: bool = False
    table_chunk: int = 0
    narrow: SdpaConfig | None = None
    narrow_width: int = 0
    narrow_segments: int = 0
    block_n_long: int = 0
    block_m_long: int = 0
    num_warps_long: int = 0
    num_stages_long: int = 0
    e4m3_qk_long: bool = False
    tma_long: bool | None = None


# What config=None means: split_merge for steps of at most 2 tokens and for one-sequence tables (the
# single-sequence cache's 2 rows: decode and a 16-token verify block), the stream-K main path for the
# rest. On the H200 (bench/results/b1-sweep-h200.json) split_merge takes one sequence from 1.27-1.82x
# SDPA exact to 0.88-0.97x at 1,024-16,384 keys and a 16-token verify block to 0.42x the main path,
# two sequences to 0.83x; from 4 decoding sequences on it is slower (1.04x at 4, 1.40x at 8).
# On e4m3 stores prompt chunks run QK^T as an e4m3 dot (e4m3_qk_long): 1.39x faster than converting K
# (122.7 against 170.9 us on two 512-token chunks), serving 1.08x (1.12x bf16 storage's tok/s against
# 1.04x), the 8B model's KL against bf16 storage 0.00110 against 0.00106 (bench/results/kv-fp8-h200.json);
# SdpaConfig(e4m3_qk_long=False) keeps q unrounded.
DEFAULT_CONFIG = SdpaConfig(
    narrow=SdpaConfig(split_merge=True, fuse_write=True, e4m3_qk_long=True),
    narrow_width=2,
    narrow_segments=2,
    e4m3_qk_long=True,
)


def pow2_floor(x: int) -> int:
    return 1 << (max(1, x).bit_length() - 1)


@functools.lru_cache(maxsize=256)
def resolve_config(
    config: SdpaConfig | None,
    head_dim: int,
    dtype: torch.dtype,
    num_kv_heads: int,
    device: torch.device,
    half_queries: bool = False,
) -> SdpaConfig:
    """`config` with every 0 field chosen from shapes alone (host-only, no device reads).

    `heads` is reduced to a divisor of num_kv_heads (gcd), so any config fits any model. The result
    is one width's config: `narrow` (already chosen by the caller) is dropped. half_queries: q is
    fp16 or bf16, which on e4m3 stores picks the long path's tiles and TMA."""
    cfg = config or DEFAULT_CONFIG
    if cfg.heads < 0 or cfg.heads & (cfg.heads - 1) or cfg.q_short < 1 or cfg.min_blocks < 1:
        raise ContractError(f"{cfg}: heads must be 0 or a power of two, q_short and min_blocks >= 1")
    if cfg.warp_split < 1 or cfg.warp_split & (cfg.warp_split - 1) or cfg.prefetch < 0 or cfg.merge_stages < 1:
        raise ContractError(f"{cfg}: warp_split must be a power of two, prefetch >= 0 and merge_stages >= 1")
    if cfg.table_chunk < 0 or cfg.table_chunk & (cfg.table_chunk - 1) or 0 < cfg.table_chunk < 16:
        raise ContractError(f"{cfg}: table_chunk must be 0 or a power of two >= 16")
    if cfg.split_merge and (cfg.heads > 1 or cfg.warp_split > 1 or cfg.prefetch):
        raise ContractError(f"{cfg}: split_merge runs one KV head per program without warp_split or prefetch")
    esize = dtype.itemsize
    heads = math.gcd(cfg.heads or 1, num_kv_heads)
    small = heads == 1 and head_dim <= 64 and cfg.warp_split == 1 and not cfg.split_merge  # small heads
    num_warps = cfg.num_warps or (cfg.warp_split if cfg.warp_split > 1 else heads if heads > 1 else 2 if small else 4)
    occupancy, num_stages = cfg.occupancy or (4 if small else 2), cfg.num_stages or (2 if small else 3)
    stage_keys = 32768 // (2 * head_dim * esize * heads)  # key positions whose K+V fill 32 KiB
    block_n = cfg.block_n or max(16 * cfg.warp_split, min(128, pow2_floor(stage_keys)))
    if cfg.warp_split > 1 and (heads > 1 or block_n < 16 * cfg.warp_split):
        raise ContractError(f"{cfg}: warp_split needs one KV head per program and block_n >= 16 * warp_split")
    wide_rows = head_dim * max(esize, 2) > 256  # e4m3 tiles are converted to 16 bits for the dots
    e4m3_tiles = half_queries and esize == 1 and head_dim <= 128  # 128-key tiles of codes, one warpgroup
    block_n_long = cfg.block_n_long or (128 if e4m3_tiles else 32 if wide_rows else 64)
    block_m_long = cfg.block_m_long or (64 if wide_rows or e4m3_tiles else 128)
    programs = cfg.programs or max(1, -(-occupancy * sm_count(device) // (num_kv_heads // heads)))
    if min(block_n, block_n_long, cfg.block_m, block_m_long) < 16 or any(n & (n - 1) for n in (block_n, block_n_long)):
        raise ContractError(f"{cfg}: tiles need at least 16 rows and a power of two, at least 16, of keys")
    max_regs = cfg.max_regs
    if not max_regs and occupancy * num_warps * 32 * 256 > REGISTERS:  # else 255 registers fit
        max_regs = max(64, REGISTERS // (occupancy * num_warps * 32) // 8 * 8)
    return replace(
        cfg,
        heads=heads,
        num_warps=num_warps,
        occupancy=occupancy,
        num_stages=num_stages,
        max_regs=max_regs,
        block_n=block_n,
        programs=programs,
        block_n_long=block_n_long,
        block_m_long=block_m_long,
        num_warps_long=cfg.num_warps_long or (4 if e4m3_tiles else 8),
        num_stages_long=cfg.num_stages_long or (2 if wide_rows or e4m3_tiles else 3),
        tma_long=e4m3_tiles if cfg.tma_long is None else cfg.tma_long,
        narrow=None,
        narrow_width=0,
        narrow_segments=0,
    )
