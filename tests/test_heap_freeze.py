"""Each process that owns its lifetime freezes the heap once its model is loaded and warm (`freeze_heap`):
`batchkv serve` (in process and in its engine process) and a tensor-parallel follower rank; `batchkv run` and
the library's own `Engine` are in test_executor_cli.py and test_executor_graphs.py."""

from __future__ import annotations

import gc
import importlib
import types

import pytest

from batchkv import cli
from batchkv.cli import serve as cli_serve
from batchkv.executor import Engine
from batchkv.serve import server
from batchkv.serve.access import Access
from batchkv.serve.jobs import ModelInfo
from batchkv.serve.loading import ServedModel
from tests.toy_model import ToyModel

launch = importlib.import_module("batchkv.tp.launch")  # the package's `launch` attribute is its function


def test_the_in_process_server_freezes_the_heap_before_it_serves(monkeypatch):
    frozen = []
    monkeypatch.setattr(server, "serve", lambda *args, **kwargs: frozen.append(gc.get_freeze_count()) or 0)
    assert gc.get_freeze_count() == 0  # conftest unfreezes after every test
    with Engine(ToyModel(seed=1), max_seqs=2, capacity=64) as engine:
        info = ModelInfo("m", None, capacity=64)
        assert server.run(engine, info, Access(), None, max_waiting=8, drain_timeout=1.0) == 0  # type: ignore[arg-type]
    assert len(frozen) == 1 and frozen[0] > 0


def test_the_engine_process_of_batchkv_serve_freezes_the_heap_once_its_engine_is_built(monkeypatch, capsys):
    monkeypatch.setattr(cli_serve, "load_model", lambda args, device: ServedModel(ToyModel(seed=2), "preset"))
    args = cli.build_parser().parse_args(["serve", "--device", "cpu", "--max-seqs", "2", "--capacity", "64"])
    assert gc.get_freeze_count() == 0
    engine, (info, max_seqs) = cli_serve.served_engine(args, "cpu", Access(), 8000)
    with engine:
        assert gc.get_freeze_count() > 0 and max_seqs == 2 and info.capacity == 64
    assert "batchkv serve" in capsys.readouterr().err


def test_a_tensor_parallel_follower_freezes_the_heap_before_it_replays_rank_0s_steps(monkeypatch):
    frozen = []

    class Role:  # stands for Follower: what follow() gives the engine and then serves
        def __init__(self, group) -> None:
            self.group = group

        def serve(self) -> None:
            frozen.append(gc.get_freeze_count())

    closed = []
    monkeypatch.setattr(launch, "Follower", Role)
    monkeypatch.setattr(launch, "Engine", lambda model, **kwargs: types.SimpleNamespace(close=lambda: closed.append(1)))
    group = types.SimpleNamespace(shard=None, device="cpu")
    launch.follow(group, types.SimpleNamespace(build=lambda shard: ToyModel(seed=3)), {})  # type: ignore[arg-type]
    assert len(frozen) == 1 and frozen[0] > 0 and closed == [1]


def test_a_ray_replica_freezes_the_heap_once_its_engine_is_warm(monkeypatch):
    import asyncio

    pytest.importorskip("ray", reason="the replica's module imports Ray (the [ray] extra)")

    from batchkv.cli import options
    from batchkv.cli.ray import EngineReplica

    monkeypatch.setattr(options, "load_model", lambda args, device: ServedModel(ToyModel(seed=4), "preset"))
    argv = ["serve", "--model", options.CPU_MODEL, "--device", "cpu", "--max-seqs", "2", "--capacity", "64"]
    flags = vars(cli.build_parser().parse_args(argv))
    replica = EngineReplica.__new__(EngineReplica)  # what Ray Serve does, without a cluster: the async constructor
    assert gc.get_freeze_count() == 0

    async def construct() -> int:
        await replica.__init__(flags)
        frozen = gc.get_freeze_count()
        replica.worker.stop()
        replica.engine.close()
        return frozen

    assert asyncio.run(construct()) > 0
    replica.__dict__.pop("worker")  # stopped and closed above
