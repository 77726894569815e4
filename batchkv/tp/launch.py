"""How an `Engine(source, tensor_parallel=N)` becomes N processes, one per GPU of a host.

`start` (rank 0; called by `batchkv.executor.launch.start` at the top of `Engine.__init__` when
N > 1, it implements that module's `Starter`) spawns ranks 1..N-1 (`rank_main`), or joins
torchrun's ranks, and returns rank 0's role (`Leader`) and its share of the model. `launch(source,
n, **options)` is `Engine(source, tensor_parallel=n, **options)` written from here. Every other
rank builds its share and then the same `Engine` from the same keywords, with a `Follower` role
(`follow`), so each rank's cache, runners, CUDA graphs and speculator are built by the same code
in the same order; then it replays rank 0's plans until rank 0 closes. Under torchrun every rank
runs the caller's script:
on ranks > 0 `Engine(...)` serves rank 0 and then exits the process (SystemExit(0)).

A DFlash drafter under tensor parallelism is given as a factory, `drafter(target)`, and is built
on every rank against that rank's target: unsharded (its few layers replicated), it embeds and
drafts with the target's vocab-parallel embedding and LM head, whose collectives run on every
rank, so its drafts are the same everywhere.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Any

import torch
from torch import nn

from batchkv.errors import ConfigError
from batchkv.executor.engine import Engine
from batchkv.executor.graphs import freeze_heap
from batchkv.models.loading import ModelSource
from batchkv.tp.group import Group, step_timeout
from batchkv.tp.roles import Follower, Leader


def _under_torchrun() -> bool:
    return all(name in os.environ for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"))


def launch(source: object, tensor_parallel: int, **options: Any) -> Engine:
    """An engine whose model is sharded over `tensor_parallel` processes: `Engine(source,
    tensor_parallel=tensor_parallel, **options)` (the engine starts the ranks through `start`)."""
    return Engine(source, tensor_parallel=tensor_parallel, **options)


def start(model: object, world: int, options: dict) -> tuple[Leader, object]:
    """Rank 0's role and model for `Engine(model, tensor_parallel=world, **options)`, world > 1: the
    other ranks started (spawned here, or torchrun's joined)."""
    source = ModelSource.of(model)
    device = torch.device(options.get("device") or ("cuda" if torch.cuda.is_available() else "cpu"))
    spec = options.get("speculative")
    if spec is not None and isinstance(spec.drafter, nn.Module):
        raise ConfigError("under tensor parallelism every rank builds its drafter: give SpeculativeConfig(drafter=) "
                          "a factory(target) -> DFlashDrafter, e.g. functools.partial(build_drafter, ...)")  # fmt: skip
    step_timeout()  # a bad BATCHKV_TP_TIMEOUT is refused before any process starts
    here = int(os.environ.get("LOCAL_WORLD_SIZE", world)) if _under_torchrun() else world  # ranks on this host
    if device.type == "cuda" and here > torch.cuda.device_count():
        raise ConfigError(
            f"{here} tensor-parallel ranks on this host need {here} GPUs; it has {torch.cuda.device_count()}"
        )
    if _under_torchrun():
        group = Group.torchrun(world, device.type)
        if group.rank > 0:
            follow(group, source, options)
            raise SystemExit(0)
    else:
        group = Group.spawn(world, device.type, rank_main, (source, options, torch.get_num_threads()))
    try:
        return Leader(group), source.build(group.shard)
    except BaseException as exc:
        group.report(exc)
        group.close(graceful=False)
        raise


def follow(group: Group, source: ModelSource, options: dict) -> None:
    """A rank > 0: build its share and its engine, then replay rank 0's plans until told to stop."""
    role = Follower(group)
    model = source.build(group.shard)
    engine = Engine(model, **{**options, "device": group.device}, _role=role)
    freeze_heap()  # as rank 0's process does: a full pass of the collector here would stall every rank's step
    role.serve()
    engine.close()


def rank_main(rank: int, world: int, port: int, device_type: str, source: ModelSource, options: dict,
              threads: int) -> None:  # fmt: skip
    """A spawned rank's process: join, follow, and on any failure report it and exit 1."""
    group = None
    try:
        group = Group.join(rank, world, port, device_type)
        if device_type == "cpu":
            torch.set_num_threads(threads)
        follow(group, source, options)
    except BaseException as exc:
        traceback.print_exc(file=sys.stderr)
        if group is not None:
            group.report(exc)
        sys.stderr.flush()
        os._exit(1)  # no atexit hooks: the process groups may be mid-collective
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the group is closed; skip the interpreter's teardown (seconds of module finalisers)
