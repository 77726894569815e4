"""The cache's array bookkeeping against the per-sequence loops it replaced, on random traces.

`LoopCache` is the previous per-sequence code (dicts of lengths, high-water marks and heights, a
Python run-length encoding, one loop per check, and the old buffer fill), kept here as the oracle.
It drives its own `ColumnStore`, so both place, grow and move extents through the same calls. Every
verb and step of a random trace goes to both: each must succeed with the same result or refuse
with the same error type and message, and every prepared step must stage the same positions, write
slots and `seq_info` table.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchkv import BatchedSequenceCache, BatchKVError, CacheConfig, LayerSpec
from batchkv.cache.store import SCRATCH, ColumnStore
from batchkv.checks import int_arg, is_int
from batchkv.errors import (
    CapacityError,
    NoFreeColumnError,
    PositionError,
    RingFloorError,
    StepError,
    UnknownSequenceError,
)

# ---- the oracle: the per-sequence bookkeeping as it was --------------------------------------


def loop_plan(seq_ids):
    """(ids, segments [(seq, q_start, q_len)], counts {seq: n}) by Python loops."""
    array = np.asarray(seq_ids)
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise UnknownSequenceError(f"declare_step takes a flat list of integer sequence ids; got {seq_ids!r}")
    ids = tuple(array.tolist())
    segments, counts, start = [], {}, 0
    for i in range(1, len(ids) + 1):  # bounded: one pass over the ids
        if i == len(ids) or ids[i] != ids[start]:
            segments.append((ids[start], start, i - start))
            start = i
    for seq in ids:
        counts[seq] = counts.get(seq, 0) + 1
    return ids, segments, counts


def loop_layout(segments, lengths):
    consumed, out = {}, []
    for seq, q_start, q_len in segments:
        base = lengths[seq] + consumed.get(seq, 0)
        consumed[seq] = consumed.get(seq, 0) + q_len
        out.append((q_start, q_len, seq, base + q_len))
    return out


class LoopCache:
    """The previous BatchedSequenceCache host bookkeeping, over its own ColumnStore."""

    def __init__(self, config: CacheConfig) -> None:
        self.config = config
        self.capacity = config.capacity
        self.store = ColumnStore(config, torch.device("cpu"))
        self.lengths: dict[int, int] = {}
        self.high_water: dict[int, int] = {}
        self.height: dict[int, int] = {}
        self.plan = None  # (ids, segments, counts)
        self.width = None
        self.staged = None

    def free_rows(self) -> int:
        return self.store.free_rows()

    def known(self, seq) -> int:
        if not is_int(seq) or seq not in self.lengths:
            held = sorted(self.lengths)
            raise UnknownSequenceError(f"sequence {seq!r} is not held (held: {held}); create it with seq_new()")
        return self.lengths[seq]

    def free_column(self) -> int:
        for col in range(self.config.max_seqs):
            if col not in self.lengths:
                return col
        raise NoFreeColumnError(
            f"all {self.config.max_seqs} columns are held; seq_rm() a finished sequence or raise max_seqs"
        )

    def height_arg(self, where, reach):
        if reach is None:
            return self.config.rows_for(1)
        why = " (positions the sequence may hold without moving)"
        return int_arg(f"{where}: reach", reach, 1, self.capacity, error=CapacityError, why=why)

    def seq_new(self, reach=None) -> int:
        height = self.height_arg("seq_new", reach)
        seq = self.free_column()
        self.store.place(seq, height)
        self.lengths[seq], self.high_water[seq], self.height[seq] = 0, 0, height
        return seq

    def ring_floor(self, seq) -> int:
        self.known(seq)
        written, cfg = self.high_water[seq], self.config
        wrapped = any(written > cfg.ring_rows(layer) for layer in range(cfg.num_layers) if cfg.ring_rows(layer))
        return max(0, written - cfg.max_write) if wrapped else 0

    def seq_clone(self, src, upto=None, reach=None) -> int:
        length = self.known(src)
        upto = length if upto is None else upto
        if not is_int(upto) or not 0 <= upto <= length:
            raise PositionError(f"seq_clone: upto={upto} is outside [0, {length}] for sequence {src}")
        floor = self.ring_floor(src)
        if upto < floor:
            raise RingFloorError(
                f"seq_clone: sequence {src} has written {self.high_water[src]} positions, so its ring "
                f"layers keep only enough for a prefix of {floor} or more; upto={upto} is below that"
            )
        height = self.height[src] if reach is None else self.height_arg("seq_clone", reach)
        if height < upto:
            raise CapacityError(f"seq_clone: reach={height} cannot hold the {upto} positions cloned; raise reach")
        dst = self.free_column()
        self.store.place(dst, height)
        self.store.copy_prefix(src, dst, upto)
        self.lengths[dst], self.high_water[dst], self.height[dst] = int(upto), self.high_water[src], height
        return dst

    def seq_rm(self, seq) -> None:
        self.known(seq)
        self.store.release(seq)
        del self.lengths[seq], self.high_water[seq], self.height[seq]
        if self.plan is not None and seq in self.plan[2]:
            self.plan, self.width = None, None

    def rewind(self, seq, new_len) -> None:
        length = self.known(seq)
        if not is_int(new_len) or not 0 <= new_len <= length:
            raise PositionError(
                f"rewind: sequence {seq} holds {length} positions; new_len={new_len} is outside [0, {length}]"
            )
        floor = self.ring_floor(seq)
        if new_len < floor:
            raise RingFloorError(
                f"rewind: sequence {seq} has written {self.high_water[seq]} positions; its ring layers "
                f"(max_write {self.config.max_write}) can resume no earlier than {floor}, not {new_len}"
            )
        self.lengths[seq] = int(new_len)
        if self.plan is not None and seq in self.plan[2]:
            self.width = None

    def resize(self, heights) -> None:
        grow = {seq: h for seq, h in heights.items() if h > self.height[seq]}
        if not grow:
            return
        total = sum(h - self.height[seq] for seq, h in grow.items())
        if total > self.free_rows():
            raise CapacityError(
                f"the store can give {self.free_rows()} more rows but growing sequences {sorted(grow)} needs {total}; "
                "finish or remove sequences, or give the store more rows (pool_rows)"
            )
        self.store.resize(grow, keep={seq: self.high_water[seq] for seq in grow})
        for seq, height in grow.items():
            self.height[seq] = height
            if self.plan is not None and seq in self.plan[2]:
                self.width = None

    def growth(self, layout):
        ends = {}
        for _, _, seq, kv_end in layout:
            ends[seq] = max(ends.get(seq, 0), kv_end)
        return {seq: self.config.rows_for(end) for seq, end in ends.items() if end > self.height[seq]}

    def declare_step(self, seq_ids) -> None:
        ids, segments, counts = loop_plan(seq_ids)
        cfg = self.config
        if len(ids) == 0:
            raise StepError("declare_step needs at least one token id")
        if len(ids) > cfg.max_width:
            raise CapacityError(f"declare_step: {len(ids)} tokens exceed max_width={cfg.max_width}")
        for seq in counts:
            self.known(seq)
        if len(segments) > cfg.max_segments:
            raise CapacityError(
                f"declare_step: {len(segments)} runs exceed max_segments={cfg.max_segments}; "
                "pack each sequence's tokens together"
            )
        for seq, n in counts.items():
            if n > cfg.max_write:
                raise CapacityError(
                    f"declare_step: sequence {seq} writes {n} tokens; max_write is {cfg.max_write} "
                    "(split its prefill into smaller chunks)"
                )
            if self.lengths[seq] + n > cfg.capacity:
                raise CapacityError(
                    f"sequence {seq} needs {self.lengths[seq] + n} positions; capacity is {cfg.capacity} "
                    "(raise capacity or finish the sequence)"
                )
        growth = self.growth(loop_layout(segments, self.lengths))
        more = sum(h - self.height[seq] for seq, h in growth.items())
        if more > self.free_rows():
            raise CapacityError(
                f"declare_step: the sequences {sorted(growth)} need {more} more rows and the store can give "
                f"{self.free_rows()}; finish or remove sequences, or give the store more rows (pool_rows)"
            )
        self.plan, self.width = (ids, segments, counts), None

    def prepare_step(self, width) -> None:
        width = int_arg("prepare_step: width", width, error=StepError)
        if self.plan is None:
            raise StepError("prepare_step: no step is declared; call declare_step(seq_ids) first")
        ids = self.plan[0]
        if not len(ids) <= width <= self.config.max_width:
            raise StepError(
                f"prepare_step: width {width} must cover the {len(ids)} declared tokens "
                f"and be at most max_width={self.config.max_width}"
            )
        layout = loop_layout(self.plan[1], self.lengths)
        self.resize(self.growth(layout))
        self.staged = self.fill(layout, width)
        for _, _, seq, kv_end in layout:
            self.high_water[seq] = max(self.high_water[seq], kv_end)
        self.width = width

    def fill(self, layout, width):
        """The old StepBuffers.fill: positions [width], slots [groups, width], seq_info [groups, S, 4]."""
        cfg, store = self.config, self.store
        groups = len(store.groups)
        info = np.zeros((groups, cfg.max_segments, 4), dtype=np.int64)
        pos = np.zeros(width, dtype=np.int64)
        slots = np.zeros((groups, width), dtype=np.int64)
        for q_start, q_len, _, kv_end in layout:
            for i in range(q_len):
                pos[q_start + i] = kv_end - q_len + i
        for g in range(groups):
            scratch_base = store.base(g, SCRATCH) if cfg.scratch_rows else 0
            for i in range(width):
                slots[g, i] = scratch_base + i % max(cfg.scratch_rows, 1)
            for s, (q_start, q_len, seq, kv_end) in enumerate(layout):
                base, rows = store.base(g, seq), store.rows(g, seq)
                info[g, s] = (q_start, q_len, base, kv_end)
                for i in range(q_len):
                    slots[g, q_start + i] = base + pos[q_start + i] % rows
        return pos, slots, info

    def commit_step(self) -> None:
        if self.plan is None or self.width is None:
            raise StepError("commit_step: no prepared step; declare_step and prepare_step come first")
        for seq, n in self.plan[2].items():
            self.lengths[seq] += n
        self.plan, self.width = None, None


# ---- the property -------------------------------------------------------------------------------


def outcome(call):
    """(result, None) or (None, (error type, message)); an untyped error fails the test."""
    try:
        return call(), None
    except BatchKVError as exc:
        return None, (type(exc), str(exc))


def state(cache: BatchedSequenceCache) -> dict:
    held = cache.sequences
    return {
        "lengths": {s: cache.pos(s) for s in held},
        "floors": {s: cache.ring_floor(s) for s in held},
        "reach": {s: cache.reach(s) for s in held},
        "prepared": cache.prepared,
    }


def loop_state(loop: LoopCache) -> dict:
    held = sorted(loop.lengths)
    return {
        "lengths": dict(loop.lengths),
        "floors": {s: loop.ring_floor(s) for s in held},
        "reach": dict(loop.height),
        "prepared": loop.width is not None,
    }


def staged(cache: BatchedSequenceCache, width: int):
    buffers = cache._buffers
    return (
        buffers.positions[:width].numpy(),
        buffers.slots[:, :width].numpy(),
        buffers.seq_info.numpy().astype(np.int64),
    )


LAYOUTS = [
    (LayerSpec("flat"), LayerSpec("ring", window=2)),
    (LayerSpec("ring", window=3),),
    (LayerSpec("flat"),),
]


def run_trace(data, pool_rows: int) -> None:
    layers = data.draw(st.sampled_from(LAYOUTS), label="layers")
    max_write = data.draw(st.integers(1, 3), label="max_write")
    max_seqs = 4
    cfg = CacheConfig(
        num_layers=len(layers), kv_heads=1, head_dim=4, max_seqs=max_seqs, capacity=20, max_write=max_write,
        layers=layers, dtype=torch.float32, buckets=(4, 8), tail_step=4, pool_rows=pool_rows,
        max_segments=data.draw(st.sampled_from([max_seqs, 2 * max_seqs]), label="max_segments"), max_width=8,
    )  # fmt: skip
    cache, loop = BatchedSequenceCache(cfg, "cpu", attention="reference"), LoopCache(cfg)
    any_id = st.integers(-1, max_seqs)  # includes ids never held
    reach = st.none() | st.integers(0, 22)  # includes refusals on both sides

    def near(seq) -> int:
        if seq not in loop.lengths:
            return data.draw(st.integers(0, 3))
        if data.draw(st.booleans()):
            return loop.ring_floor(seq) + data.draw(st.integers(-1, 2))
        return loop.lengths[seq] - data.draw(st.integers(-1, 5))

    def check(verb: str, *args, width: int | None = None) -> bool:
        """Call `verb` on both; same result or same refusal, same state, same staged buffers."""
        got, want = outcome(lambda: getattr(cache, verb)(*args)), outcome(lambda: getattr(loop, verb)(*args))
        assert got == want, (verb, args, got, want)
        assert state(cache) == loop_state(loop), verb
        if width is not None and want[1] is None:
            for a, b in zip(staged(cache, width), loop.staged, strict=True):
                np.testing.assert_array_equal(a, b)
        return want[1] is None

    verbs = ["new", "clone", "rm", "rewind", "declare", "prepare", "commit", *["step"] * 5]
    for _ in range(data.draw(st.integers(5, 40), label="ops")):
        op = data.draw(st.sampled_from(verbs))
        if op == "step" and loop.lengths:  # a whole step over held sequences, packed or split
            ids = data.draw(st.lists(st.sampled_from(sorted(loop.lengths)), min_size=1, max_size=8), label="step")
            if data.draw(st.booleans()):
                ids = sorted(ids, key=ids.index)
            width = len(ids) + data.draw(st.integers(0, 2))
            if check("declare_step", ids) and check("prepare_step", width, width=width) and data.draw(st.booleans()):
                check("commit_step")
        elif op in ("new", "step"):
            check("seq_new", data.draw(reach))
        elif op == "clone":
            src = data.draw(any_id)
            check("seq_clone", src, data.draw(st.none() | st.just(near(src))), data.draw(reach))
        elif op == "rm":
            check("seq_rm", data.draw(any_id))
        elif op == "rewind":
            seq = data.draw(any_id)
            check("rewind", seq, near(seq))
        elif op == "declare":
            held = sorted(loop.lengths) or [0]
            ids = data.draw(st.lists(st.sampled_from(held) | any_id, min_size=0, max_size=10), label="ids")
            if data.draw(st.booleans()):  # most declarations pack each sequence together
                ids = sorted(ids, key=ids.index)
            check("declare_step", np.asarray(ids, dtype=np.int32) if data.draw(st.booleans()) else ids)
        elif op == "prepare":
            width = data.draw(st.integers(0, 9))
            check("prepare_step", width, width=width)
        else:
            check("commit_step")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_array_bookkeeping_stages_and_refuses_exactly_as_the_per_sequence_loops(data):
    run_trace(data, pool_rows=0)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_array_bookkeeping_matches_the_loops_in_a_fixed_pool_where_extents_move_and_compact(data):
    run_trace(data, pool_rows=36)


@pytest.mark.parametrize("ids", [[0, 0, 1, 0, 2, 2, 1], [3, 1, 3, 3, 0, 1, 1, 2, 3], [5]])
def test_a_split_declaration_continues_each_sequence_run_after_run(ids):
    from batchkv.cache.step import Declaration

    plan = Declaration.from_ids(ids)
    _, segments, counts = loop_plan(ids)
    lengths = {seq: 10 * seq for seq in counts}
    want = loop_layout(segments, lengths)
    kv_end = plan.kv_end(np.array([lengths.get(i, 0) for i in range(6)]))
    got = list(zip(plan.q_start.tolist(), plan.q_len.tolist(), plan.seqs.tolist(), kv_end.tolist(), strict=True))
    assert got == want
    assert dict(zip(plan.members.tolist(), plan.counts.tolist(), strict=True)) == counts
    assert plan.members.tolist() == list(counts)  # first appearance order: the refusals' order
