"""What a `BatchedSequenceCache` lets a caller read: sizes, the storage's generation and planes, a
sequence's rows, and the prepared step's device tables. Read-only; the cache's state itself (its
arrays, its store, its step buffers) is set up and changed by `batchkv.cache.batch`."""

from __future__ import annotations

import torch

from batchkv.checks import int_arg, is_int
from batchkv.errors import ContractError, PositionError, UnknownSequenceError
from batchkv.ops.sdpa.config import DEFAULT_CONFIG

SHORT_RUN = DEFAULT_CONFIG.q_short  # the most tokens of a run that the attention's split path takes (16)


class CacheViews:
    """The read-only side of `BatchedSequenceCache` (a base class of it: no state of its own)."""

    @property
    def max_seqs(self) -> int:
        return self.config.max_seqs

    @property
    def capacity(self) -> int:
        return self.config.capacity

    @property
    def short_step(self) -> bool:
        """Whether every run of the declared step has at most SHORT_RUN tokens (decode, verify blocks of up to 16):
        with `short_hint` on, such a step's attention launches no prompt-chunk kernel, so a graph
        captured over the cache keys on this as it does on the width."""
        return self._declaration is not None and self._declaration.longest <= SHORT_RUN

    @property
    def generation(self) -> int:
        """Moves whenever storage is reallocated; a graph captured before is stale."""
        return self._store.generation

    @property
    def nbytes(self) -> int:
        """Bytes of K/V storage currently allocated."""
        return self._store.nbytes

    @property
    def pool_rows(self) -> int:
        """Rows of the flat layers' pool: every sequence's extent and the scratch rows together."""
        return self._store.pool_rows(0)

    @property
    def free_rows(self) -> int:
        """Rows the flat pool can still give to extents (a pool that grows on demand counts the rows
        it may still grow by, up to every sequence at capacity)."""
        return self._store.free_rows()

    def reach(self, seq: int) -> int:
        """Positions `seq` holds without its extent moving (its flat extent's rows)."""
        self._known(seq)
        return int(self._height[seq])

    @property
    def positions(self) -> torch.Tensor:
        """Device int64 [W]: KV position of each packed token of the prepared step (padding -> 0)."""
        return self._buffers.positions[: self._width or 0]

    @property
    def prepared(self) -> bool:
        """True between a successful `prepare_step` and the step's commit (or its invalidation)."""
        return self._width is not None

    @property
    def seq_info(self) -> torch.Tensor:
        """Device int32 [max_segments, 4]: the staged (q_start, q_len, col, kv_end) table of the first
        layer group (flat layers' when there are any); `col` is the extent's first row in its pool."""
        return self._buffers.seq_info[0]

    @property
    def sequences(self) -> list[int]:
        """Ids currently held, ascending."""
        return list(self._ids)

    @property
    def num_sequences(self) -> int:
        """How many ids are held."""
        return len(self._ids)

    @property
    def _lengths(self) -> dict[int, int]:
        """id -> positions held, of every held id (a copy; for tests and debugging)."""
        return {seq: int(self._len[seq]) for seq in self.sequences}

    @property
    def _high_water(self) -> dict[int, int]:
        """id -> most positions ever written, of every held id (a copy; for tests and debugging)."""
        return {seq: int(self._hw[seq]) for seq in self.sequences}

    def k_store(self, layer: int) -> torch.Tensor:
        """Layer's K pool [P, 1, Hkv, D]. Its address changes when `generation` does."""
        return self._store.k[self._layer(layer)]

    @property
    def fuses_rope(self) -> bool:
        """Whether `update_and_attend(rope=)` rotates q and k in the K/V write's launch: no key rotation or
        rounding follows RoPE, and `update_and_attend` is the cache's own (a subclass overriding it may
        read q and k, as `batchkv.score`'s calibration does, and gets them rotated). Either way
        `update_and_attend` takes them unrotated with rope and attends the same."""
        own = type(self).update_and_attend.__qualname__ == "BatchedSequenceCache.update_and_attend"
        return own and self._rotation is None and self._rounding is None

    def v_store(self, layer: int) -> torch.Tensor:
        """Layer's V pool [P, 1, Hkv, D]. Its address changes when `generation` does."""
        return self._store.v[self._layer(layer)]

    def column(self, seq: int, layer: int) -> dict[str, torch.Tensor]:
        """Views of `seq`'s rows in `layer`: k, v [rows, Hkv, D] in `config.kv_dtype` (and, for e4m3
        storage, k_scale, v_scale fp32 [rows, Hkv]); position p sits at row p % rows. The views
        stay valid until the extent moves (growth, compaction) or storage does (`generation`)."""
        self._known(seq)
        return self._store.extent(seq, self._layer(layer))

    def _layer(self, layer: int) -> int:
        return int_arg("layer", layer, 0, self.config.num_layers - 1, error=ContractError)

    def planes(self, layer: int) -> dict[str, torch.Tensor]:
        """Every storage plane of `layer` by name: k, v [P, 1, Hkv, D] in `config.kv_dtype` and, for
        e4m3 storage, k_scale, v_scale fp32 [P, 1, Hkv] (value = code * scale)."""
        return self._store.layer(self._layer(layer))

    def _holds(self, seq: object) -> bool:
        return is_int(seq) and 0 <= seq < self.config.max_seqs and bool(self._held[seq])  # type: ignore[operator]

    def _known(self, seq: int) -> int:
        if not self._holds(seq):
            held = self.sequences
            raise UnknownSequenceError(f"sequence {seq!r} is not held (held: {held}); create it with seq_new()")
        return int(self._len[seq])

    def pos(self, seq: int) -> int:
        """One past the newest position of `seq` (its length)."""
        return self._known(seq)

    def can_admit(self, seq: int, n: int = 1) -> bool:
        """Whether `seq` may still grow by `n` positions within capacity (whatever its reach now: a step
        grows the extent). False for unknown ids."""
        n = int_arg("can_admit: n", n, 0, error=PositionError)
        return self._holds(seq) and int(self._len[seq]) + n <= self.capacity
