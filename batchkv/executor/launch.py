"""How an engine gets its model and its role: a built model, a source loaded here, or ranks started.

`start(model, tensor_parallel, options)`, at the top of `Engine.__init__`:
- a built model (it has `cache_spec`) with one process: that model, and `LOCAL`;
- a source (preset, model directory, GGUF file, factory(shard)) with one process: the whole model
  loaded by `batchkv.models.loading`, and `LOCAL`;
- more processes: the tensor-parallel starter's answer (rank 0's role, a `Leader`, and its share).

The rule for that last arrow: tensor parallelism sits above the executor (its ranks build
engines), so the executor does not import it. It names the starter's module, `TENSOR_PARALLEL`, and
imports it by that name only when an engine asks for more than one process; the module implements
`Starter` (`batchkv.tp.launch.start`). This is the one place the executor reaches above itself,
and it does so through this protocol, never through tp's code.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any, Protocol

import torch

from batchkv.checks import int_arg
from batchkv.executor.roles import LOCAL, Role
from batchkv.models.loading import ModelSource
from batchkv.models.parallel import Shard

MAX_RANKS = 64
TENSOR_PARALLEL = "batchkv.tp.launch"  # the module whose `start` launches ranks (a `Starter`)


class Starter(Protocol):
    """Starts the other ranks for `Engine(source, tensor_parallel=world, **options)`: returns rank
    0's role and rank 0's share of the model (each rank builds its own)."""

    def __call__(self, model: object, world: int, options: dict) -> tuple[Role, Any]: ...


def start(model: object, tensor_parallel: int, options: dict) -> tuple[Role, Any]:
    """This process's role and model for `Engine(model, tensor_parallel=..., **options)`."""
    world = int_arg("Engine tensor_parallel", tensor_parallel, 1, MAX_RANKS, why=" (one process per GPU)")
    if world == 1 and callable(getattr(model, "cache_spec", None)):
        return LOCAL, model  # a built model: the single-process engine
    if world == 1:
        source = ModelSource.of(model)
        device = torch.device(options.get("device") or ("cuda" if torch.cuda.is_available() else "cpu"))
        return LOCAL, source.build(Shard(device=device))
    starter: Starter = importlib.import_module(TENSOR_PARALLEL).start
    return starter(model, world, options)


def stops_ranks_on_failure(init):
    """`Engine.__init__`, which on any failure first stops the ranks its start launched (they would
    otherwise wait for a rank 0 that never becomes ready)."""

    @functools.wraps(init)
    def build(self, *args, **kwargs) -> None:
        try:
            init(self, *args, **kwargs)
        except BaseException:
            role = self.__dict__.get("role")
            if role is not None:
                role.close()
            raise

    return build
