"""BatchedSequenceCache: BatchControl over a column store.

Host planning (between forwards, never inside a captured region):
    seq_new, seq_clone, seq_rm, rewind, pos, can_admit, begin_step (declare + prepare), commit_step.
Device work (per layer, inside the forward, capturable):
    update_and_attend(layer, q, k, v) -- write the step's K/V at its slots, then sdpa_varlen.

A refused call raises a `BatchKVError` subclass and changes nothing: lengths, histories, the
standing declaration and the staged buffers stay as they were. The read-only accessors are in
`views.py`, the single-sequence facade's hooks in `hooks.py`, the memory check in `footprint.py`.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Sequence

import numpy as np
import torch

from batchkv import ops
from batchkv.cache import footprint, rotation
from batchkv.cache.config import CacheConfig
from batchkv.cache.contract import check_attend_args
from batchkv.cache.hooks import FacadeHooks
from batchkv.cache.staging import Staging
from batchkv.cache.step import Declaration, Placement, StepBuffers
from batchkv.cache.store import SCRATCH, Allocator, ColumnStore
from batchkv.cache.views import SHORT_RUN, CacheViews
from batchkv.checks import allocating, device_arg, int_arg, is_int
from batchkv.errors import CapacityError, ConfigError, NoFreeColumnError, PositionError, RingFloorError, StepError
from batchkv.ops.support import refusal


class BatchedSequenceCache(CacheViews, FacadeHooks):
    """KV cache of up to `max_seqs` sequences in one column store, one column per sequence.

    Sequence ids are column indexes: `seq_new` hands out the lowest free one, and ids recycle. A
    column is an *extent* of consecutive rows in each layer group's pool, as tall as the sequence
    can reach (`seq_new(reach=...)`; without one it starts at the row schedule's first height and
    grows, moving to new rows, when a step needs more), so a sequence costs memory for what it can
    reach, not for what the longest one can (see `batchkv.cache.store`).

    Example:
        cache = BatchedSequenceCache(CacheConfig(num_layers=2, kv_heads=2, head_dim=16,
                                                 max_seqs=4, capacity=256, max_write=8), "cpu")
        a = cache.seq_new()
        cache.declare_step([a, a, a]); cache.prepare_step(width=4)
        out = cache.update_and_attend(0, q, k, v)   # q [4, Hq, 16], k/v [4, 2, 16]; every layer
        cache.commit_step()                          # cache.pos(a) == 3

    `attention` picks the kernels: "auto" (Triton on CUDA when available, else the torch
    reference), "triton" or "reference". An unknown or unavailable `device` is a ConfigError; a
    store the device cannot hold is a CapacityError with the bytes asked for. `short_hint` (off, the
    engine's runner sets it per step): a `short_step` attends with no prompt-chunk launch.
    """

    short_hint = False

    def __init__(
        self,
        config: CacheConfig,
        device: torch.device | str = "cpu",
        *,
        attention: str = "auto",
        alloc: Allocator = torch.empty,
    ) -> None:
        if not isinstance(config, CacheConfig):
            raise ConfigError(f"config is a {type(config).__name__}; pass a CacheConfig")
        self.config = config
        self.device = device_arg(device, "BatchedSequenceCache device")
        self.attention = ops.resolve_backend(attention, self.device)
        # Refused here, not at the first attend inside a forward (or a graph capture).
        problem = refusal(config.kv_dtype, config.head_dim, self.attention, self.device, config.value_dim)
        if problem:
            raise ConfigError(f"{problem}; use attention='reference'" if self.attention == "triton" else problem)
        self._attend = ops.backend_functions(self.attention)[1]  # it also does the step's K/V write
        footprint.check_static(config, self.device)
        self._store = ColumnStore(config, self.device, alloc)
        sizes = (config.max_width, len(self._store.groups), config.max_segments)
        with allocating("the step buffers", Staging.nbytes(StepBuffers.sizes(*sizes)), "lower max_width or max_seqs"):
            self._buffers = StepBuffers(*sizes, self.device)
        self._rotation = rotation.build_rotation(config, self.device)  # None unless e4m3 keys rotate
        rounding = config.key_rounding  # None: the write rounds e4m3 keys to nearest
        self._rounding = None if rounding is None else rounding.to(self.device)
        # Per-sequence state in arrays indexed by id (STYLE 24), changed when a sequence changes;
        # a step gathers from them. The extents' rows live in the pools' own arrays (RowPool.bases).
        n = config.max_seqs
        self._held = np.zeros(n, dtype=bool)
        self._len = np.zeros(n, dtype=np.int64)  # positions held
        self._hw = np.zeros(n, dtype=np.int64)  # most positions ever written (ring floor)
        self._height = np.zeros(n, dtype=np.int64)  # rows of its flat extent (positions it holds without moving)
        self._declared = np.zeros(n, dtype=bool)  # named by the standing declaration
        self._ids: list[int] = []  # ids held, ascending
        self._released: list[int] = []  # heap of freed ids, all below _fresh
        self._fresh = 0  # no id from here up was ever handed out
        rings = [config.ring_rows(layer) for layer in range(config.num_layers) if config.ring_rows(layer)]
        self._min_ring = min(rings, default=0)  # a sequence wrapped some ring once it wrote more
        self._declaration: Declaration | None = None
        # The last declaration made and a copy of its ids: a steady decode step declares the ids of the one before
        # and reuses its segments (one comparison, no run-length encoding); the state checks still run every step.
        self._last: tuple[np.ndarray, Declaration] | None = None
        self._width: int | None = None  # set by prepare_step, cleared by commit/invalidation

    static_bytes = staticmethod(footprint.static_bytes)

    # ---- sequence verbs (host) ----------------------------------------------------------------
    def _free_column(self) -> int:
        """The lowest free id (not taken yet: `_hold` takes it)."""
        if self._released:
            return self._released[0]
        if self._fresh < self.max_seqs:
            return self._fresh
        raise NoFreeColumnError(f"all {self.max_seqs} columns are held; seq_rm() a finished sequence or raise max_seqs")

    def _hold(self, seq: int, length: int, high_water: int, height: int) -> None:
        """Take the id `_free_column` gave (its extents placed) with its state."""
        if self._released and self._released[0] == seq:
            heapq.heappop(self._released)
        else:
            self._fresh += 1
        bisect.insort(self._ids, seq)
        self._held[seq] = True
        self._len[seq], self._hw[seq], self._height[seq] = length, high_water, height

    def seq_new(self, reach: int | None = None) -> int:
        """A new empty sequence; returns the lowest free id.

        reach: positions it may hold without its extent moving (at most capacity); None: the row
        schedule's first height (`config.rows_for(1)`), grown as steps need. A store that cannot
        give the rows is a CapacityError, and nothing changes.
        """
        height = self._height_arg("seq_new", reach)
        seq = self._free_column()
        self._store.place(seq, height)
        self._hold(seq, 0, 0, height)
        return seq

    def _height_arg(self, where: str, reach: int | None) -> int:
        if reach is None:
            return self.config.rows_for(1)
        why = " (positions the sequence may hold without moving)"
        return int_arg(f"{where}: reach", reach, 1, self.capacity, error=CapacityError, why=why)

    def ring_floor(self, seq: int) -> int:
        """Shortest length `seq` may be rewound or cloned to: past it a ring has lost the window."""
        self._known(seq)
        written = int(self._hw[seq])
        wrapped = self._min_ring and written > self._min_ring  # some ring layer wrapped
        return max(0, written - self.config.max_write) if wrapped else 0

    def seq_clone(self, src: int, upto: int | None = None, reach: int | None = None) -> int:
        """A new sequence holding a device copy of `src`'s first `upto` positions (default all).

        reach: positions the clone may hold without moving (default `src`'s reach; at least upto).
        """
        length = self._known(src)
        upto = length if upto is None else upto
        if not is_int(upto) or not 0 <= upto <= length:
            raise PositionError(f"seq_clone: upto={upto} is outside [0, {length}] for sequence {src}")
        floor = self.ring_floor(src)
        if upto < floor:
            raise RingFloorError(
                f"seq_clone: sequence {src} has written {self._hw[src]} positions, so its ring "
                f"layers keep only enough for a prefix of {floor} or more; upto={upto} is below that"
            )
        height = int(self._height[src]) if reach is None else self._height_arg("seq_clone", reach)
        if height < upto:
            raise CapacityError(f"seq_clone: reach={height} cannot hold the {upto} positions cloned; raise reach")
        src = int(src)
        dst = self._free_column()
        self._store.place(dst, height)
        self._store.copy_prefix(src, dst, upto)
        # its ring rows hold what the donor wrote
        self._hold(dst, int(upto), int(self._hw[src]), height)
        return dst

    def seq_rm(self, seq: int) -> None:
        """Free `seq`'s column (its rows go back to the pool). A declared (or prepared) step that
        names it is dropped."""
        self._known(seq)
        seq = int(seq)
        self._store.release(seq)
        del self._ids[bisect.bisect_left(self._ids, seq)]
        heapq.heappush(self._released, seq)
        self._held[seq] = False
        self._len[seq] = self._hw[seq] = self._height[seq] = 0
        if self._declaration is not None and self._declared[seq]:
            self._drop_declaration()

    def _drop_declaration(self) -> None:
        if self._declaration is not None:
            self._declared[self._declaration.members] = False
        self._declaration, self._width = None, None

    def rewind(self, seq: int, new_len: int) -> None:
        """Move `seq`'s length back to `new_len` (speculative rejection, retries)."""
        length = self._known(seq)
        if not is_int(new_len) or not 0 <= new_len <= length:
            raise PositionError(
                f"rewind: sequence {seq} holds {length} positions; new_len={new_len} is outside [0, {length}]"
            )
        floor = self.ring_floor(seq)
        if new_len < floor:
            raise RingFloorError(
                f"rewind: sequence {seq} has written {self._hw[seq]} positions; its ring layers "
                f"(max_write {self.config.max_write}) can resume no earlier than {floor}, not {new_len}"
            )
        self._len[seq] = int(new_len)
        self._restage(seq)

    def _restage(self, seq: int) -> None:
        """`seq`'s length moved: a declared step naming it keeps its declaration but must be prepared again."""
        if self._declaration is not None and self._declared[seq]:
            self._width = None  # staged positions are stale

    def reserve(self, seq: int, length: int) -> bool:
        """Grow `seq`'s extent now so it can reach `length` positions without moving mid-run.

        Returns False when it already held them. A store that cannot give the rows (a fixed pool
        that is full, or out of device memory: the bytes asked for in the message) is a
        CapacityError, and nothing changes. A declared step naming `seq` must be prepared again.
        """
        self._known(seq)
        height = int_arg("reserve: length", length, error=PositionError)
        if not 0 < height <= self.capacity:
            raise CapacityError(f"reserve: length {length} is outside [1, capacity={self.capacity}]")
        return self._resize({int(seq): height})

    def _resize(self, heights: dict[int, int]) -> bool:
        """Grow the extents of the sequences in `heights` (all or none: a refusal changes nothing)."""
        grow = {seq: h for seq, h in heights.items() if h > self._height[seq]}
        if not grow:
            return False
        total = sum(h - int(self._height[seq]) for seq, h in grow.items())
        if total > self.free_rows:
            raise CapacityError(
                f"the store can give {self.free_rows} more rows but growing sequences {sorted(grow)} needs {total}; "
                "finish or remove sequences, or give the store more rows (pool_rows)"
            )
        self._store.resize(grow, keep={seq: int(self._hw[seq]) for seq in grow})
        for seq, height in grow.items():
            self._height[seq] = height
            self._restage(seq)
        return True

    # ---- step protocol (host) -----------------------------------------------------------------
    def begin_step(self, seq_ids: Sequence[int], width: int) -> None:
        """`declare_step(seq_ids)` then `prepare_step(width)` in one verb (the engine's), each check
        made once and before anything changes: a refusal leaves the previous declaration standing."""
        width = int_arg("begin_step: width", width, error=StepError)
        decl, growth = self._checked(seq_ids)
        decl.refuse_width("begin_step", width, self.config.max_width)
        self._declare(decl)
        self._stage(decl, growth, width)

    def declare_step(self, seq_ids: Sequence[int]) -> None:
        """Declare the next forward: one sequence id per packed token, in packed order.

        Runs of equal ids become segments; a sequence may appear in several runs. A refusal leaves
        the previous declaration standing. O(1) Python: every check is one array operation over
        the step's tokens, segments or sequences.
        """
        self._declare(self._checked(seq_ids)[0])

    def _checked(self, seq_ids: Sequence[int]) -> tuple[Declaration, dict[int, int]]:
        """`seq_ids`' declaration and the heights its sequences grow to, after declare_step's checks."""
        decl = self._decl(seq_ids)
        cfg = self.config
        if decl.num_tokens == 0:
            raise StepError("declare_step needs at least one token id")
        if decl.num_tokens > cfg.max_width:
            raise CapacityError(f"declare_step: {decl.num_tokens} tokens exceed max_width={cfg.max_width}")
        members = decl.members
        known = (members >= 0) & (members < cfg.max_seqs)
        known[known] = self._held[members[known]]
        if not known.all():  # the first unknown id, in packed order
            self._known(members[np.argmin(known)].item())
        if decl.num_segments > cfg.max_segments:
            raise CapacityError(
                f"declare_step: {decl.num_segments} runs exceed max_segments={cfg.max_segments}; "
                "pack each sequence's tokens together"
            )
        decl.refuse_writes(self._len[members], cfg.max_write, cfg.capacity)
        growth = self._growth(decl)
        if growth:
            more = sum(h - int(self._height[seq]) for seq, h in growth.items())
            if more > self.free_rows:
                raise CapacityError(
                    f"declare_step: the sequences {sorted(growth)} need {more} more rows and the store can give "
                    f"{self.free_rows}; finish or remove sequences, or give the store more rows (pool_rows)"
                )
        return decl, growth

    def _decl(self, seq_ids: Sequence[int]) -> Declaration:
        """`Declaration.from_ids(seq_ids)`, or the last one made when its ids are the same."""
        ids, last = np.asarray(seq_ids), self._last
        if last is not None and ids.dtype.kind in "iu" and ids.shape == last[0].shape and np.array_equal(ids, last[0]):
            return last[1]
        decl = Declaration.from_ids(ids)
        self._last = (ids.copy(), decl)  # a copy: the caller may write its array again
        return decl

    def _declare(self, decl: Declaration) -> None:  # `decl` checked by `_checked`
        self._drop_declaration()
        self._declared[decl.members] = True
        self._declaration = decl

    def _growth(self, decl: Declaration) -> dict[int, int]:
        """The extent heights the sequences of a step must grow to (those that must): a sequence
        ends the step at its length plus its tokens."""
        ends = self._len[decl.members] + decl.counts
        short = ends > self._height[decl.members]
        if not short.any():
            return {}
        grow = zip(decl.members[short].tolist(), ends[short].tolist(), strict=True)
        return {seq: self.config.rows_for(end) for seq, end in grow}

    def prepare_step(self, width: int) -> None:
        """Grow storage if the declared step needs it, then stage its device buffers.

        `width` >= declared tokens is the forward's packed width; rows past the declared tokens are
        padding (they write to the scratch column and come out of attention as zeros).
        """
        width = int_arg("prepare_step: width", width, error=StepError)
        decl = self._declaration
        if decl is None:
            raise StepError("prepare_step: no step is declared; call declare_step(seq_ids) first")
        decl.refuse_width("prepare_step", width, self.config.max_width)
        self._stage(decl, self._growth(decl), width)

    def _stage(self, decl: Declaration, growth: dict[int, int], width: int) -> None:  # grow, then stage
        if growth:
            self._resize(growth)  # grow before staging, so a refusal leaves the cache as it was
        self._buffers.fill(decl, decl.kv_end(self._len), self._placements(), width)
        # Written on the device from now on, whether or not the step commits.
        members = decl.members
        self._hw[members] = np.maximum(self._hw[members], self._len[members] + decl.counts)
        self._width = width

    def _placements(self) -> list[Placement]:
        """Each layer group's extents (arrays by sequence id) and its scratch extent."""
        store, scratch = self._store, self.config.scratch_rows
        return [
            Placement(group.pool.bases, group.pool.sizes, store.base(g, SCRATCH) if scratch else 0, scratch)
            for g, group in enumerate(store.groups)
        ]

    def commit_step(self) -> None:
        """Advance every declared sequence by its tokens in the step; clears the declaration."""
        if self._declaration is None or self._width is None:
            raise StepError("commit_step: no prepared step; declare_step and prepare_step come first")
        self._len[self._declaration.members] += self._declaration.counts
        self._drop_declaration()

    # ---- device work (capturable) -------------------------------------------------------------
    def update_and_attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          scale: float | None = None, causal: bool = True, softcap: float | None = None,
                          sinks: torch.Tensor | None = None, rope: tuple | None = None) -> torch.Tensor:  # fmt: skip
        """Write this step's K/V for `layer`, then attend over each sequence's history.

        q: [W, Hq, D] (the output's dtype), Hq a multiple of Hkv; k, v: [W, Hkv, D] (cast to the
        store's dtype on write); all three float16/bfloat16/float32, W the prepared width, on the
        cache's device with a contiguous last dim. Returns [W, Hq, D] in q's dtype; padding
        rows are exact zeros. e4m3 storage quantises K/V in the write and dequantises in the
        attention kernel (fp32 accumulation); on the Triton default, prompt chunks round q to e4m3
        too (`SdpaConfig.e4m3_qk_long`). Every argument is checked (shapes, dtypes, devices:
        attributes only, no tensor reads) before anything is written, so a refusal leaves the store
        as it was. Capturable: reads only device buffers staged by `prepare_step`, whose addresses
        are fixed for a given `generation`.

        softcap (None or 0: none): each scaled score s becomes softcap * tanh(s / softcap) (Gemma2's
        attention logit soft-capping). sinks: one logit per query head, float [Hq] on the cache's
        device, in every row's softmax denominator (gpt-oss's attention sinks), or None. rope: (cos, sin)
        [W, D] when q and k come unrotated: the write's launch rotates both (`sdpa_varlen(rope=)`).
        """
        if self._width is None:
            raise StepError("update_and_attend: no prepared step; call declare_step and prepare_step first")
        check_attend_args(self.config, self._width, self._buffers.seq_info.device, layer, q, k, v, scale, causal,
                          softcap, sinks)  # fmt: skip
        width, cfg = self._width, self.config
        if not causal and self._declaration is not None and self._declaration.split:
            raise StepError("a non-causal step needs each sequence's tokens in one run (a draft block is one segment)")
        q, k, rope = rotation.keys_for_write(self._rotation, self._rounding, layer, q, k, v, rope)
        store, group = self._store.layer(layer), self._store.group_of[layer]
        slots = self._buffers.slots[group, :width]
        seq_info = self._buffers.seq_info[group]
        if self.attention == "reference":  # not captured: it reads the step's segments, not every row
            seq_info = seq_info[: self._buffers.segments]
        else:  # every segment holds one of the step's tokens at least: a step of width W has <= W
            seq_info = seq_info[: min(len(seq_info), width)]  # fixed per width, so graph-safe; the kernels'
            # plans read only the step's segments (`live`, staged with the table), not every row of the slice
        return self._attend(  # the step's K/V written first (a kv_write launch, or inside the attention)
            q, store["k"], store["v"], seq_info, scale=scale, causal=causal,
            window=cfg.layers[layer].window, k_scale=store.get("k_scale"), v_scale=store.get("v_scale"),
            write=(k, v, slots), rows=self._store.modulus(layer), softcap=float(softcap or 0.0), sinks=sinks,
            max_q_len=SHORT_RUN if self.short_hint and self.short_step else None, rope=rope, live=self._buffers.live,
        )  # fmt: skip
