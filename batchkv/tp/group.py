"""The processes of a tensor-parallel engine: start, rendezvous, timeouts, failure reports, stop.

`Group.spawn` (rank 0, in the caller's process) starts N - 1 processes with torch.multiprocessing
(spawn) and a local rendezvous: a TCPStore on 127.0.0.1 at a port the OS picks, which every rank
joins (`Group.join`). Under torchrun (`Group.torchrun`) the ranks are torchrun's and its store is
used; they may span hosts (`torchrun --nnodes N --node-rank R --rdzv-endpoint HOST:PORT`), each rank
on its node's GPU LOCAL_RANK. Every rank then holds three process groups:
- the default one, NCCL on CUDA (rank r on cuda:r) or gloo on the CPU: the model's collectives,
  each bounded by `step_timeout()` (BATCHKV_TP_TIMEOUT seconds, default 120);
- `plans`, gloo: rank 0's step plans (`batchkv.tp.channel`); the other ranks wait on it while
  the engine is idle, so its timeout is a year, and a dead rank 0 ends them instead (below);
- `control`, gloo: construction-time agreement (store sizing, the ready barrier), bounded by
  START_TIMEOUT (ranks load their shards at their own pace).

Every process batchkv starts has NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and
NVSHMEM_DISABLE_NVLS=1 (NVLink multicast stays off). Faults: a rank that raises writes its error
to the store (`report`) and exits; its peers' collectives then fail at once (gloo: the
connection closes), and rank 0 turns that into a `TensorParallelError` naming the rank and its
error (`failure`). A rank that dies without a word is seen by rank 0's watcher thread (its exit
code), which on NCCL aborts the communicators so no device wait hangs. Spawned ranks die with
rank 0's thread that spawned them (PR_SET_PDEATHSIG) and ignore SIGINT: Ctrl-C reaches rank 0,
which stops them (`close`). Under torchrun rank 0 has no processes to watch: every other rank bumps
a counter in the store every HEARTBEAT_S (`_beat`, on a connection of its own), and a rank that
neither reported an error nor moved its counter while rank 0 waited REPORT_WAIT is named as the
one that stopped, with its node and host (counters, not clocks: hosts' clocks differ). A node that
drops off the network without a word fails the next collective within BATCHKV_TP_TIMEOUT.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import math
import multiprocessing.connection
import os
import signal
import socket
import threading
import time
import traceback

import torch
import torch.distributed as dist

from batchkv.errors import ConfigError, TensorParallelError
from batchkv.models.parallel.shard import Shard

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
START_TIMEOUT = datetime.timedelta(minutes=30)
IDLE_TIMEOUT = datetime.timedelta(days=365)
MAX_STEP_TIMEOUT = 86400.0  # seconds: a day
REPORT_WAIT = 3.0  # seconds rank 0 waits for a failed rank's report
_REPORT = "batchkv/failed/{}"
_JOINED = "batchkv/joined/{}"
_NODE = "batchkv/node/{}"  # torchrun: "node R (host)" of a rank
_BEAT = "batchkv/beat/{}"  # torchrun: a rank's heartbeat counter
HEARTBEAT_S = 0.5


def step_timeout() -> datetime.timedelta:
    """Bound of every collective of a step: BATCHKV_TP_TIMEOUT seconds (default 120)."""
    text = os.environ.get("BATCHKV_TP_TIMEOUT", "120")
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds <= MAX_STEP_TIMEOUT:  # also refuses nan
        raise ConfigError(f"BATCHKV_TP_TIMEOUT is {text!r}; give seconds in (0, {MAX_STEP_TIMEOUT:.0f}], e.g. 120")
    return datetime.timedelta(seconds=seconds)


def no_multicast() -> None:
    """Keep NVLink multicast off in this process and in every process it starts."""
    os.environ.update(NO_MULTICAST)


class Group:
    """This process's place in a tensor-parallel group: rank, world, device, process groups, store."""

    def __init__(
        self, rank: int, world: int, device_type: str, store: object, procs: list, local_rank: int | None = None
    ) -> None:
        self.rank, self.world, self.store, self.procs = rank, world, store, procs
        local = rank if local_rank is None else local_rank  # this rank's GPU on its host
        self.device = torch.device("cuda", local) if device_type == "cuda" else torch.device("cpu")
        if device_type == "cuda":
            torch.cuda.set_device(self.device)
        if not dist.is_initialized():
            backend = "nccl" if device_type == "cuda" else "gloo"
            extra = {"device_id": self.device} if device_type == "cuda" else {}
            dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=step_timeout(), **extra)
        self.plans = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        self.control = dist.new_group(backend="gloo", timeout=START_TIMEOUT)
        self.shard = Shard(rank, world, self.device)
        self.failed: str | None = None  # why the group stopped, once it has
        self.lost = False  # the watcher saw a rank's process end (the group is then stopped at the next fixed point)
        self._closing = False
        if procs:
            threading.Thread(target=self._watch, name="batchkv-tp-watch", daemon=True).start()

    # ---- starting ---------------------------------------------------------------------------
    @classmethod
    def spawn(cls, world: int, device_type: str, target, args: tuple) -> Group:
        """Rank 0 of a new group: start ranks 1..world-1 as `target(rank, world, port, device_type, *args)`."""
        no_multicast()
        if dist.is_initialized():
            raise ConfigError("torch.distributed is already initialised in this process (another tensor-parallel "
                              "engine is open?): close it first, or run under torchrun")  # fmt: skip
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False, timeout=START_TIMEOUT)
        context = torch.multiprocessing.get_context("spawn")
        procs = []
        try:
            for rank in range(1, world):
                proc = context.Process(target=target, args=(rank, world, store.port, device_type, *args), daemon=True)
                proc.start()
                procs.append(proc)
            _await_ranks(store, procs)
            return cls(0, world, device_type, store, procs)
        except BaseException:
            _stop(procs)
            raise

    @classmethod
    def join(cls, rank: int, world: int, port: int, device_type: str) -> Group:
        """A spawned rank joins rank 0's rendezvous (and dies with rank 0; Ctrl-C is rank 0's to handle)."""
        _die_with_parent()
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=START_TIMEOUT)
        store.set(_JOINED.format(rank), "1")
        return cls(rank, world, device_type, store, [])

    @classmethod
    def torchrun(cls, world: int, device_type: str) -> Group:
        """This process's place among torchrun's ranks (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_*)."""
        no_multicast()
        if int(os.environ["WORLD_SIZE"]) != world:
            raise ConfigError(f"tensor_parallel={world} but torchrun started {os.environ['WORLD_SIZE']} processes; "
                              "make them equal")  # fmt: skip
        rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
        if not dist.is_initialized():
            device = torch.device("cuda", local) if device_type == "cuda" else None
            backend = "nccl" if device_type == "cuda" else "gloo"
            dist.init_process_group(backend, timeout=step_timeout(), **({"device_id": device} if device else {}))
        store = dist.distributed_c10d._get_default_store()
        store.set(_NODE.format(rank), f"node {os.environ.get('GROUP_RANK', '0')} ({socket.gethostname()})")
        if rank > 0:
            threading.Thread(target=_beat, args=(rank,), name="batchkv-tp-beat", daemon=True).start()
        return cls(rank, world, device_type, store, [], local_rank=local)

    # ---- faults -----------------------------------------------------------------------------
    def report(self, exc: BaseException) -> None:
        """A rank's last act when it fails: its error, for rank 0's message."""
        text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        with contextlib.suppress(Exception):  # the store (rank 0) is gone too: nobody is left to tell
            self.store.set(_REPORT.format(self.rank), text)

    def failure(self, cause: BaseException | None) -> TensorParallelError:
        """The error rank 0 raises once any rank has failed; the group is stopped first."""
        if self.failed is None:
            deadline = time.monotonic() + REPORT_WAIT
            beats = None if self.procs else self._beats()  # torchrun: heartbeats before the wait
            for proc in self.procs:  # a rank that failed reports, then exits: wait for that first
                proc.join(max(0.0, deadline - time.monotonic()))
            found = []
            for rank in range(1, self.world):
                key = _REPORT.format(rank)
                while not self.procs and not self.store.check([key]) and time.monotonic() < deadline:
                    time.sleep(0.05)  # torchrun: no process to wait for
                if self.store.check([key]):
                    found.append(f"{self._where(rank)} raised {self.store.get(key).decode()}")
                elif self.procs and self.procs[rank - 1].exitcode not in (None, 0):
                    found.append(f"rank {rank} exited with code {self.procs[rank - 1].exitcode}")
            if beats is not None:
                after = self._beats()
                reported = {rank for rank in range(1, self.world) if self.store.check([_REPORT.format(rank)])}
                gone = [rank for rank, n in after.items() if n == beats[rank] and rank not in reported]
                found += [f"{self._where(rank)} stopped (its process or its host is gone: no heartbeat for "
                          f"{REPORT_WAIT:.0f} s)" for rank in gone]  # fmt: skip
            if not found:
                found.append(f"rank 0's step failed: {type(cause).__name__}: {cause}" if cause else "a rank stopped")
            self.failed = "; ".join(found)
        self.close(graceful=False)
        return TensorParallelError(f"tensor parallelism stopped: {self.failed}. The engine cannot step again; "
                                   "build a new one")  # fmt: skip

    def _beats(self) -> dict[int, int]:
        """torchrun: each other rank's heartbeat count (-1: none yet, or the store is gone)."""
        out = {}
        for rank in range(1, self.world):
            try:
                out[rank] = int(self.store.get(_BEAT.format(rank))) if self.store.check([_BEAT.format(rank)]) else -1
            except Exception:  # the store went with its host
                out[rank] = -1
        return out

    def _where(self, rank: int) -> str:
        """'rank R', and under torchrun 'on node N (host)'."""
        key = _NODE.format(rank)
        try:
            return f"rank {rank} on {self.store.get(key).decode()}" if self.store.check([key]) else f"rank {rank}"
        except Exception:
            return f"rank {rank}"

    @property
    def broken(self) -> bool:
        """True once a rank failed or its process ended: every fixed point then raises `failure`."""
        return self.failed is not None or self.lost

    def _watch(self) -> None:
        """Rank 0: wake when a rank's process ends; unless closing, note it and unblock the device."""
        multiprocessing.connection.wait([p.sentinel for p in self.procs])
        if self._closing:
            return
        self.lost = True
        if self.device.type == "cuda":  # graph-replayed NCCL kernels would wait forever for the dead rank
            dist.distributed_c10d._abort_process_group()

    # ---- stopping ---------------------------------------------------------------------------
    def close(self, graceful: bool) -> None:
        """Stop the group: wait for the other ranks to leave (graceful: they were told to), else stop them."""
        if self._closing:
            return
        self._closing = True
        for proc in self.procs:
            proc.join(30.0 if graceful else 0.0)
        _stop(self.procs)
        if dist.is_initialized():
            if graceful or self.device.type != "cuda":
                dist.destroy_process_group()
            else:  # a communicator may be stuck in a collective with a dead rank
                dist.distributed_c10d._abort_process_group()


def _await_ranks(store: object, procs: list) -> None:
    """Wait until every spawned rank has reached the store; one that ends first is an error at once."""
    deadline = time.monotonic() + START_TIMEOUT.total_seconds()
    for rank, proc in enumerate(procs, start=1):
        while not store.check([_JOINED.format(rank)]):
            if not proc.is_alive() or time.monotonic() > deadline:
                proc.join(1.0)
                _stop(procs)
                raise TensorParallelError(
                    f"tensor-parallel rank {rank}'s process ended (exit code {proc.exitcode}) before it joined. Its "
                    "traceback is above; a script that builds a tensor-parallel Engine needs `if __name__ == "
                    "'__main__':` around it, since every rank's process imports the script"
                )
            time.sleep(0.01)


def _beat(rank: int) -> None:
    """torchrun, a rank > 0: bump this rank's heartbeat counter every HEARTBEAT_S, on a store
    connection of its own (torchrun's store, at MASTER_ADDR:MASTER_PORT), until the process ends."""
    try:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=datetime.timedelta(seconds=30))  # fmt: skip
        while True:
            store.add(_BEAT.format(rank), 1)
            time.sleep(HEARTBEAT_S)
    except Exception:  # the store is gone (rank 0's host): nobody is listening
        return


def _stop(procs: list) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
            proc.join(5.0)
        if proc.is_alive():
            proc.kill()
            proc.join(5.0)


def _die_with_parent() -> None:
    """Linux: this process gets SIGKILL when the thread that started it ends (rank 0 gone)."""
    parent = os.getppid()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: rank 0's close (and the daemon flag) must do
        return
    if os.getppid() != parent:  # the parent ended before the request took effect
        os._exit(1)
