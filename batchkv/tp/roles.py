"""The multi-rank roles: how rank 0 and the other ranks answer the engine's fixed points.

The engine and its runners call their role (`batchkv.executor.roles.Role`: `cache`, `bind`, `run`,
`read`, `agree`, `ready`, `close`) at the same few points whatever the world size; one process
holds `batchkv.executor.roles.LOCAL`, where each is a plain call.

With more ranks, rank 0, the `Leader`, runs the scheduler, the API and the host side of every cache. Its caches are
`MirroredCache`s: each BatchControl verb that changes state is logged once it has succeeded (a
refusal changes nothing and is not logged). At `run`, rank 0 sends one plan (`PlanChannel`): the
verbs logged since the last plan, the step's method and arguments, and what changed in the
object's staging buffers since the last plan (indexes and values; the buffers start zero-filled
on every rank). The other ranks, `Follower`s, replay the verbs on their own caches, install the
staged values and call the same step, so every rank runs the same cache verbs (its store holds
its share of the KV heads; placement is in rows, the same for any head count), the same staged
inputs and the same captured graph, and samples the same tokens from the same gathered logits
(a pure function of identical inputs). Why verbs rather than the staged cache buffers: a verb
also moves K/V on the device (a fork's clone, an extent's growth or compaction), which every rank
must do to its own heads; replaying the verbs does that and fills the step buffers identically.
Followers check that seq_new and seq_clone hand out rank 0's ids, so a divergence is an error,
not wrong tokens. A failure anywhere stops every rank (`Group.failure`): TP has no retry.
"""

from __future__ import annotations

import functools
import time

import numpy as np
import torch
import torch.distributed as dist

from batchkv.cache import BatchedSequenceCache, CacheConfig
from batchkv.cache.staging import Staging
from batchkv.errors import ConfigError, TensorParallelError
from batchkv.tp.channel import PlanChannel

MIRRORED = ("seq_new", "seq_clone", "seq_rm", "rewind", "reserve", "begin_step", "declare_step", "prepare_step",
            "commit_step", "_set_length")  # fmt: skip  # every BatchedSequenceCache method that changes its state
CHECKED = ("seq_new", "seq_clone")  # their results (ids) must agree on every rank


def _mirrored(name: str):
    verb = getattr(BatchedSequenceCache, name)

    @functools.wraps(verb)
    def call(self, *args, **kwargs):
        self._depth += 1
        try:
            out = verb(self, *args, **kwargs)
        finally:
            self._depth -= 1
        if self._depth == 0:  # not a verb another verb called
            args = tuple(list(a) if isinstance(a, list) else a for a in args)
            self._log.append((self._index, name, args, kwargs, out if name in CHECKED else None))
        return out

    return call


class MirroredCache(BatchedSequenceCache):
    """Rank 0's cache: a `BatchedSequenceCache` that logs its state-changing verbs for the other ranks."""

    def __init__(self, config: CacheConfig, device: torch.device, *, attention: str, log: list, index: int) -> None:
        super().__init__(config, device, attention=attention)
        self._log, self._index, self._depth = log, index, 0

    def _load_prefix(self, seq, keys, values) -> None:
        raise ConfigError("loading external K/V is not mirrored across tensor-parallel ranks (each holds its "
                          "own heads); the single-sequence facade runs with tensor_parallel=1")  # fmt: skip


for _name in MIRRORED:
    setattr(MirroredCache, _name, _mirrored(_name))


class _Ranked:
    """What both multi-rank roles hold: the group, the bound objects by index, their staging."""

    capture_error_mode = "thread_local"  # NCCL's watchdog thread may query CUDA during a capture

    def __init__(self, group) -> None:
        self.group, self.rank, self.world = group, group.rank, group.world
        self.channel = PlanChannel(group.plans)
        self.objects: list[object] = []
        self.staging: dict[int, Staging] = {}

    def _register(self, obj: object, staging: Staging | None = None) -> int:
        self.objects.append(obj)
        if staging is not None:
            self.staging[len(self.objects) - 1] = staging
        return len(self.objects) - 1

    def bind(self, obj: object, staging: Staging) -> None:
        self._register(obj, staging)

    def share(self, tensor: torch.Tensor) -> None:
        """Rank 0's `tensor` into every rank's (a broadcast on the model's group, inside a step)."""
        dist.broadcast(tensor, src=0)

    def agree(self, positions: int) -> int:
        value = torch.tensor([positions], dtype=torch.int64)
        dist.all_reduce(value, op=dist.ReduceOp.MIN, group=self.group.control)
        return int(value)

    def ready(self) -> None:
        dist.barrier(group=self.group.control)


class Leader(_Ranked):
    """Rank 0: logs cache verbs, sends a plan before every device step, turns failures into one error."""

    def __init__(self, group) -> None:
        super().__init__(group)
        self._log: list[tuple] = []
        self._sent: dict[int, dict[torch.dtype, np.ndarray]] = {}  # staged values the other ranks hold

    def cache(self, config: CacheConfig, device: torch.device, *, attention: str) -> BatchedSequenceCache:
        return self._guard(lambda: self._new_cache(config, device, attention))

    def _new_cache(self, config: CacheConfig, device: torch.device, attention: str) -> MirroredCache:
        cache = MirroredCache(config, device, attention=attention, log=self._log, index=len(self.objects))
        self._register(cache)
        return cache

    def bind(self, obj: object, staging: Staging) -> None:
        index = self._register(obj, staging)
        self._sent[index] = {dtype: np.zeros_like(host) for dtype, host in staging.peek().items()}

    def run(self, step, *args):
        index = self.objects.index(step.__self__)
        plan = (list(self._log), (index, step.__name__, args, self._delta(index)))
        self._log.clear()
        return self._guard(lambda: (self.channel.send(plan), step(*args))[1])

    def _delta(self, index: int) -> dict:
        """What changed in object `index`'s staged host buffers since the last plan (rank 0 staged it)."""
        out = {}
        for dtype, host in self.staging[index].peek().items():
            sent = self._sent[index][dtype]
            where = np.flatnonzero(host != sent)
            out[dtype] = (None, host.copy()) if 3 * len(where) > len(host) else (where.astype(np.int32), host[where])
            sent[:] = host
        return out

    def read(self, tokens):
        """The step's tokens; on CUDA the wait is bounded by the step timeout and by the watcher."""
        if self.group.device.type == "cuda":
            self._guard(lambda: self._wait(tokens))
        runs = tokens.read()
        if self.group.broken:  # a rank died while the device ran: these tokens are not to be trusted
            raise self.group.failure(None)
        return runs

    def _wait(self, tokens) -> None:
        from batchkv.tp.group import step_timeout

        event = tokens.event
        done = event.query if event is not None else torch.cuda.current_stream(self.group.device).query
        deadline = time.monotonic() + step_timeout().total_seconds()
        while not done():
            if time.monotonic() > deadline:
                self.group.failed = self.group.failed or f"a step took longer than {step_timeout()} (a rank hangs)"
            if self.group.broken:
                raise TensorParallelError(self.group.failed or "a rank's process ended")
            time.sleep(0)

    def agree(self, positions: int) -> int:
        return self._guard(lambda: super(Leader, self).agree(positions))

    def ready(self) -> None:
        self._guard(super().ready)
        self._built = True

    _built = False  # every rank finished building its engine (until then close stops them at once)

    def _guard(self, fn):
        if self.group.broken:
            raise self.group.failure(None)
        try:
            return fn()
        except KeyboardInterrupt:  # Ctrl-C mid-step leaves the ranks out of step: stop them, then stop
            self.group.failed = self.group.failed or "interrupted (Ctrl-C) on rank 0"
            self.group.close(graceful=False)
            raise
        except Exception as exc:
            raise self.group.failure(exc) from exc

    def close(self) -> None:
        """Tell the other ranks to stop (if they still listen), then stop the group."""
        graceful = not self.group.broken and self._built
        if graceful:
            try:
                self.channel.send(None)
            except Exception:  # a rank is gone: close stops the rest
                graceful = False
        self.group.close(graceful=graceful)


class Follower(_Ranked):
    """A rank > 0: replays rank 0's plans until told to stop."""

    def cache(self, config: CacheConfig, device: torch.device, *, attention: str) -> BatchedSequenceCache:
        cache = BatchedSequenceCache(config, device, attention=attention)
        self._register(cache)
        return cache

    def run(self, step, *args):  # reached only by a replayed step
        return step(*args)

    def read(self, tokens):
        return tokens.read()

    def serve(self) -> None:
        """Replay plans until rank 0 sends None (close)."""
        while (plan := self.channel.recv()) is not None:
            log, (index, name, args, delta) = plan
            for target, verb, vargs, kwargs, expected in log:
                out = getattr(self.objects[target], verb)(*vargs, **kwargs)
                if expected is not None and out != expected:
                    raise TensorParallelError(f"rank {self.rank}'s cache diverged: {verb} gave {out}, not {expected}")
            staging = self.staging[index]
            host = staging.begin()
            for dtype, (where, values) in delta.items():
                if where is None:
                    host[dtype][:] = values
                else:
                    host[dtype][where] = values
            staging.upload()
            getattr(self.objects[index], name)(*args)

    def close(self) -> None:
        self.group.close(graceful=True)
