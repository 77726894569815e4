"""batchkv on Ray Serve: N engine replicas anywhere in a Ray cluster behind one OpenAI-compatible
endpoint, each request sent to the replica whose prefix cache holds most of its prompt
(needs `pip install 'batchkv[ray]'`; nothing else in batchkv imports ray).

    batchkv serve --model /models/Qwen3-0.6B --ray-replicas 2 --port 8000
    serve run batchkv.cli.ray:build model=/models/Qwen3-0.6B ray-replicas=2    # Ray's own CLI
    serve deploy config.yaml     # import_path: batchkv.cli.ray:build, args: {model: ..., ...}

Two deployments. `BatchkvFrontend` (one replica by default, no GPU) is batchkv's own HTTP app (the
routes, limits, templates, tokenising and detokenising of `batchkv serve`) over a `RemoteWorker`,
which hands each request's engine requests (token ids) to `BatchkvEngine` through a deployment
handle and streams the events back. `BatchkvEngine` replicas each hold one `Engine` on its engine
thread (`EngineWorker`), built from the same options as `batchkv serve` (`--tensor-parallel-size N`:
each replica is N processes on N GPUs of one node). The builder's arguments are `batchkv serve`'s
flags (`model=...`, `max-seqs=16`, `ray-replicas=2`); what is Ray's is set the Ray way, in a Serve
config file's `deployments:` entry for `BatchkvEngine`: `num_replicas` (an int, or `auto` with an
`autoscaling_config` of min/max replicas), `health_check_period_s` (a replica whose engine thread stopped fails
`check_health` and is replaced), `ray_actor_options` (GPUs, CPUs).

Routing (`PrefixAffinityRouter`, a Ray Serve `RequestRouter`): Ray's `PrefixCacheAffinityRouter`
(ray.serve.llm) keys on the request's text in a tree of what it routed; batchkv's frontend has
already tokenised, so the router hashes the prompt's 16-token blocks exactly as the engine's prefix
index does (`batchkv.executor.prefix.block_hashes`) and asks each replica's index: every replica
reports the chain hashes its prefix cache indexes through Ray's routing stats
(`record_routing_stats`, every `STATS_PERIOD_S`), and the router adds the blocks it sent each
replica since (a burst of requests sharing a new prefix lands on one replica before any report).
A request goes to the replica that holds the most leading blocks of its prompt among those whose
queue is within `imbalance` requests of the shortest (default 4 * max_seqs); with no match, to the
shortest queue (ties: the smaller index), else Ray's power-of-two choice.

A request cancelled by its client cancels the replica's stream (its engine requests end). One
prompt of a batch that finished on a stop string is not cancelled alone over Ray: its replica
decodes it to its own end. The frontend's /metrics counts HTTP refusals; the engine's gauges are
per replica (`replica_stats`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from typing import Any

import ray
from ray import serve
from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter  # Ray's default router
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import (
    LocalityMixin,
    MultiplexMixin,
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from batchkv.errors import ConfigError
from batchkv.executor import Request
from batchkv.executor.prefix import block_hashes
from batchkv.serve.protocol import APIError

ENGINE, FRONTEND, APP = "BatchkvEngine", "BatchkvFrontend", "batchkv"
STATS_PERIOD_S = 1.0  # how often each replica reports its prefix index to the routers
REMEMBERED = 1 << 16  # blocks a router remembers sending each replica (least recently sent dropped)


# ---- the router ---------------------------------------------------------------------------------
class PrefixAffinityRouter(LocalityMixin, MultiplexMixin, RequestRouter):
    """Sends a request to the replica whose prefix index holds most of its prompt's leading 16-token
    blocks (see the module docstring); Ray's power-of-two choice when there is nothing to match.
    Not FIFO (as Ray's own prefix router): a replica chosen for a request serves that request, where
    Ray's FIFOMixin would hand it to the oldest one waiting."""

    def initialize_state(self, imbalance: float = 32.0) -> None:
        self.imbalance = float(imbalance)
        self._sent: dict[ReplicaID, OrderedDict[int, None]] = {}  # blocks sent since the replica's reports
        self._reported: dict[ReplicaID, tuple[object, frozenset[int]]] = {}  # (the stats' list, its set)

    def _held(self, replica: RunningReplica) -> frozenset[int]:
        """The blocks `replica` last reported (converted once per report)."""
        blocks = (replica.routing_stats or {}).get("blocks", ())
        seen = self._reported.get(replica.replica_id)
        if seen is None or seen[0] is not blocks:  # held, so a new report is never mistaken for it
            seen = self._reported[replica.replica_id] = (blocks, frozenset(blocks))
        return seen[1]

    def _depth(self, replica: RunningReplica, blocks: list[int]) -> int:
        """Leading blocks of the prompt that `replica` holds or was sent."""
        held, sent = self._held(replica), self._sent.get(replica.replica_id, {})
        depth = 0
        for block in blocks:
            if block not in held and block not in sent:
                break
            depth += 1
        return depth

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        blocks = _request_blocks(pending_request)
        queue = {r.replica_id: self.replica_queue_len_cache.get(r.replica_id) for r in candidate_replicas}
        open_ = [r for r in candidate_replicas if (queue[r.replica_id] or 0) < r.max_ongoing_requests]
        if not blocks or not open_:
            return await PowerOfTwoChoicesRequestRouter.choose_replicas(self, candidate_replicas, pending_request)
        shortest = min(queue[r.replica_id] or 0 for r in open_)
        eligible = [r for r in open_ if (queue[r.replica_id] or 0) - shortest <= self.imbalance]
        depth = {r.replica_id: self._depth(r, blocks) for r in eligible}

        def rank(r: RunningReplica) -> tuple:  # most blocks, then the shortest queue, then the smaller index
            return (
                -depth[r.replica_id],
                queue[r.replica_id] or 0,
                len(self._held(r)) + len(self._sent.get(r.replica_id, ())),
            )

        best = min(eligible, key=rank)
        self._remember(best.replica_id, blocks)
        return [[best]]

    def _remember(self, replica: ReplicaID, blocks: list[int]) -> None:
        sent = self._sent.setdefault(replica, OrderedDict())
        for block in blocks:
            sent[block] = None
            sent.move_to_end(block)
        while len(sent) > REMEMBERED:
            sent.popitem(last=False)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id for r in replicas}
        for table in (self._sent, self._reported):
            for replica in [r for r in table if r not in live]:
                del table[replica]

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._sent.pop(replica_id, None)
        self._reported.pop(replica_id, None)


def _request_blocks(pending: PendingRequest | None) -> list[int]:
    """The block hashes of the first prompt of a `BatchkvEngine.generate(requests, ...)` call."""
    if pending is None or not pending.args or not isinstance(pending.args[0], list) or not pending.args[0]:
        return []
    request = pending.args[0][0]
    if not isinstance(request, Request):  # another method's call: no prompt to route by
        return []
    return block_hashes(request.prompt_ids, request.rope_offset)


# ---- the engine replica ---------------------------------------------------------------------------
class EngineReplica:
    """One engine on its engine thread, built from `batchkv serve`'s options (a dict of its flags)."""

    async def __init__(self, options: dict[str, Any]) -> None:
        from batchkv.cli.options import build_engine, load_model, resolve_device, set_threads
        from batchkv.cli.serve import limits_from, use_tokenizer
        from batchkv.executor.graphs import freeze_heap
        from batchkv.serve.metrics import ServerMetrics
        from batchkv.serve.worker import EngineWorker

        args = argparse.Namespace(**options)
        set_threads(args)
        device = resolve_device(args)
        served = load_model(args, device)
        self.engine = build_engine(args, served, device)
        use_tokenizer(self.engine, served.tokenizer)  # constrained decoding, when it can
        self.engine.warm_up()  # graphs captured before the first request (0 s without graphs)
        freeze_heap()  # the replica serves until it exits: no full pass of the collector walks the model
        self.metrics = ServerMetrics(self.engine.cache.max_seqs)
        timeout = limits_from(args).request_timeout
        self.worker = EngineWorker(self.engine, self.metrics, max_waiting=args.max_waiting, request_timeout=timeout)
        self.worker.start(asyncio.get_running_loop())

    async def generate(self, requests: list, waited: float) -> AsyncIterator[Any]:
        """Stream the engine's events of `requests` (waited: seconds since the HTTP request arrived).
        Yields None (queued) or a refusal's fields first, then (events, cached tokens by prompt)."""
        try:
            stream = await self.worker.submit(requests, time.perf_counter() - waited)
        except APIError as exc:
            yield {"status": exc.status, "message": exc.message, "type": exc.type, "param": exc.param,
                   "code": exc.code}  # fmt: skip
            return
        yield None
        left = sum(request.params.n for request in requests)  # samples still to finish
        try:
            async for items in stream:
                yield items, dict(stream.cached)
                left -= sum(event.finish_reason is not None for _, event in items)
                if left <= 0:
                    return
        finally:
            stream.cancel()  # the caller left early (a finished stream's ids are gone: a no-op)

    def check_health(self) -> None:
        """Ray's health check: a replica whose engine thread ended is replaced."""
        if not self.worker.alive:
            raise RuntimeError("the engine thread has stopped")

    def record_routing_stats(self) -> dict[str, Any]:
        """What the routers read: the prefix index's block hashes and the prefix cache's counters."""
        m = self.engine.metrics
        return {"blocks": self.engine.prefix_blocks(), "prefix_admitted": m.prefix_admitted,
                "prefix_hits": m.prefix_hits, "prefix_reused": m.prefix_reused,
                "prefix_evictions": m.prefix_evictions, "pid": os.getpid()}  # fmt: skip

    def __del__(self) -> None:
        worker = self.__dict__.get("worker")
        if worker is not None:
            worker.stop()
            self.engine.close()


# ---- the frontend ---------------------------------------------------------------------------------
class RemoteStream:
    """A `Stream`'s face over a replica's event stream."""

    def __init__(self, events) -> None:
        self.events = events  # the handle's DeploymentResponseGenerator
        self.cached: dict[int, int] = {}

    def __aiter__(self) -> AsyncIterator[list]:
        return self._items()

    async def _items(self) -> AsyncIterator[list]:
        try:
            async for items, cached in self.events:
                self.cached.update(cached)
                yield items
        except ray.exceptions.RayError as exc:
            raise APIError(503, "the engine replica failed mid-request; retry", type="server_error") from exc

    def cancel(self, prompt_index: int | None = None) -> None:
        """Cancel the whole stream (the replica cancels its engine requests); one prompt alone is not."""
        if prompt_index is None:
            self.events.cancel()


class RemoteWorker:
    """`EngineWorker`'s face (start, stop, alive, refuse_batch, submit) over the engine replicas."""

    alive = True

    def __init__(self, engines, max_waiting: int) -> None:
        self.engines, self.max_waiting = engines, max_waiting

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        pass

    def stop(self) -> None:
        pass

    def refuse_batch(self, prompts: int) -> None:
        from batchkv.serve.front import batch_error

        if prompts > self.max_waiting:
            raise batch_error(prompts, self.max_waiting)

    async def submit(self, requests: Sequence, arrival: float) -> RemoteStream:
        events = self.engines.options(stream=True).generate.remote(list(requests), time.perf_counter() - arrival)
        try:
            first = await events.__anext__()
        except ray.exceptions.RayError as exc:
            raise APIError(503, "no engine replica could take the request; retry", type="server_error") from exc
        if first is not None:
            raise APIError(**first)
        return RemoteStream(events)


class Frontend:
    """batchkv's HTTP app over the engine replicas (a Serve ingress, built at replica start)."""

    def __init__(self, engines, options: dict[str, Any]) -> None:
        from batchkv.cli.options import resolve_capacity
        from batchkv.cli.serve import access_from, limits_from
        from batchkv.serve.jobs import ModelInfo
        from batchkv.serve.loading import load_served_model
        from batchkv.serve.metrics import ServerMetrics
        from batchkv.serve.tools import check_parser

        args = argparse.Namespace(**options)
        served = load_served_model(args.model, "cpu", dtype=args.dtype, seed=args.seed, weights=False)
        name = args.served_model_name or args.model
        capacity = resolve_capacity(args.capacity, served.max_positions)
        self.info = ModelInfo(name, served.tokenizer, capacity, served.eos_ids, limits_from(args),
                              tool_parser=check_parser(args.tool_call_parser))  # fmt: skip
        self.access = access_from(args, args.host)
        self.metrics = ServerMetrics(0)
        self.worker = RemoteWorker(engines, args.max_waiting)

    def __serve_build_asgi_app__(self):
        from batchkv.serve.app import build_app

        return build_app(self.worker, self.info, self.metrics, self.access)  # type: ignore[arg-type]


# ---- building and running -------------------------------------------------------------------------
def application(args: argparse.Namespace, *, prefix_affinity: bool = True):
    """The Ray Serve application of `batchkv serve`'s options: frontend and engine deployments.
    `prefix_affinity=False`: Ray's default router (power of two choices), for comparison."""
    if args.tensor_parallel > 1 and args.device != "cuda":
        raise ConfigError("under Ray each replica's tensor-parallel ranks hold GPUs: add --device cuda")
    options = {k: v for k, v in vars(args).items() if not callable(v)}
    replicas = max(args.ray_replicas, 1)
    seqs = args.max_seqs if isinstance(args.max_seqs, int) else 256
    resources = {"num_gpus": args.tensor_parallel} if args.device == "cuda" else {"num_cpus": 1}
    router = RequestRouterConfig(
        request_router_class=PrefixAffinityRouter,
        request_router_kwargs={"imbalance": 4 * seqs},
        request_routing_stats_period_s=STATS_PERIOD_S,
    )
    engine = serve.deployment(
        EngineReplica,
        name=ENGINE,
        num_replicas=replicas,
        ray_actor_options=resources,
        max_ongoing_requests=args.max_waiting + seqs,  # beyond: the engine would answer 429
        **({"request_router_config": router} if prefix_affinity else {}),
    )
    frontend = serve.deployment(serve.ingress()(Frontend), name=FRONTEND, ray_actor_options={"num_cpus": 0})
    return frontend.bind(engine.bind(options), options)


def parser() -> argparse.ArgumentParser:
    """`batchkv serve`'s options, for `build`."""
    from batchkv.cli.serve import add_arguments

    p = argparse.ArgumentParser(prog="batchkv.cli.ray:build")
    add_arguments(p)
    return p


def build(args: dict[str, Any]):
    """Ray Serve's application builder (`serve run batchkv.cli.ray:build model=... ray-replicas=2`):
    the arguments are `batchkv serve`'s flags without their dashes (true/false for switches)."""
    argv: list[str] = []
    for key, value in args.items():
        flag = "--" + str(key).replace("_", "-")
        if str(value).lower() in ("true", "false"):
            argv += [flag] if str(value).lower() == "true" else []
        else:
            argv += [flag, str(value)]
    from batchkv.cli.serve import model_of

    parsed = parser().parse_args(argv)
    parsed.model = model_of(parsed)
    return application(parsed)


def replica_stats(app: str = APP) -> dict[str, dict[str, Any]]:
    """Each running engine replica's routing stats (its prefix counters and pid), by its actor name
    (a replica still starting, or gone, is left out)."""
    prefix = f"SERVE_REPLICA::{app}#{ENGINE}#"
    out = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["name"].startswith(prefix):
            try:
                actor = ray.get_actor(entry["name"], namespace="serve")
                out[entry["name"]] = ray.get(actor.record_routing_stats.remote(), timeout=30)
            except (ray.exceptions.RayError, ValueError):
                continue
    return out


def serve_on_ray(args: argparse.Namespace) -> int:
    """`batchkv serve --ray-replicas N`: join the Ray cluster at RAY_ADDRESS (else start one here),
    serve the application on --host:--port until SIGINT or SIGTERM, then shut Serve down."""
    ray.init()
    stop = threading.Event()  # set by SIGINT or SIGTERM, also while the replicas start
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(application(args), name=APP, route_prefix="/")
        print(f"batchkv serve: {args.served_model_name or args.model} on Ray Serve, {args.ray_replicas} replicas, "
              f"prefix-affinity routing; http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)  # fmt: skip
        while not stop.wait(1.0):
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        serve.shutdown()
        ray.shutdown()
    return 0
