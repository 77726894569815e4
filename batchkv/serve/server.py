"""`batchkv serve`: load the model, start the engine thread, run uvicorn, shut down cleanly.

Shutdown on SIGINT or SIGTERM: uvicorn stops accepting connections; requests in flight may finish
for `--drain-timeout` seconds, then the engine thread cancels the rest (their streams end with
finish_reason "abort", their columns are freed) and new submits get 503. Then the engine thread
stops and the process exits 0. A second SIGINT forces the exit.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys

from batchkv.errors import ConfigError
from batchkv.frontend import MODES, kv_dtype_option, model_source, scheduling_kwargs, speculative_option
from batchkv.serve.options import DEFAULT_CAPACITY, access_from, add_arguments, api_key, is_loopback, limits_from

__all__ = ["add_arguments", "serve"]


def _ignore(signum: int, frame: object) -> None:
    """Stands in for the default handlers while uvicorn serves: uvicorn re-raises the signal that
    stopped it once it has shut down, and a default handler would turn a clean stop into a kill."""


def _uvicorn_server(uvicorn):
    class Server(uvicorn.Server):
        """uvicorn's server, telling the engine thread to drain when a signal stops it."""

        def __init__(self, config, on_exit) -> None:
            super().__init__(config)
            self.on_exit = on_exit

        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            self.on_exit()

    return Server


def _device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda but CUDA is not available here; use --device cpu")
    return name


def _listen(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port for uvicorn (which listens on it). Bound before the model
    loads, so an address in use or one this machine does not have is a one-line ConfigError at once."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)  # as uvicorn
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart reuses the port at once
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(
            f"cannot listen on {host}:{port}: {exc.strerror or exc} (choose another --port or --host)"
        ) from None
    return sock


def serve(args: argparse.Namespace) -> int:
    """Run the server until a signal stops it; returns the exit status."""
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn
    except ImportError as exc:
        raise ConfigError(f"batchkv serve needs its extra: pip install 'batchkv[serve]' ({exc})") from exc
    import torch

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = _device(args.device)
    key = api_key(args)
    sock = _listen(args.host, args.port)
    bound = sock.getsockname()[0]
    if key is None and not is_loopback(bound):
        print(
            f"batchkv serve: warning: listening on {args.host} (not a loopback address) without an API key: anyone "
            "who reaches this address can use the server (set --api-key or BATCHKV_API_KEY)",
            file=sys.stderr,
            flush=True,
        )
    try:
        return _serve(args, uvicorn, sock, device)
    finally:
        sock.close()


def _serve(args: argparse.Namespace, uvicorn, sock: socket.socket, device: str) -> int:
    import torch

    from batchkv.executor import Engine
    from batchkv.serve.app import build_app
    from batchkv.serve.jobs import ModelInfo
    from batchkv.serve.loading import load_served_model
    from batchkv.serve.metrics import ServerMetrics
    from batchkv.serve.worker import EngineWorker

    tp = args.tensor_parallel  # > 1: the ranks load their shares, this process only what serving text needs
    served = load_served_model(args.model, device, dtype=args.dtype, seed=args.seed, weights=tp == 1,
                               quantization=args.quantization)  # fmt: skip
    dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
    model = served.model if tp == 1 else model_source(args.model, seed=args.seed, dtype=dtype,
                                                      quantization=args.quantization)  # fmt: skip
    limit = served.max_positions
    capacity = args.capacity or min(DEFAULT_CAPACITY, limit or DEFAULT_CAPACITY)
    if limit and capacity > limit:
        raise ConfigError(f"--capacity {capacity} is beyond the model's max_position_embeddings {limit}; lower it")
    engine = Engine(
        model,
        tensor_parallel=tp,
        **scheduling_kwargs(args, device),
        capacity=capacity,
        max_step_tokens=args.max_step_tokens,
        prefill_chunk=args.prefill_chunk,  # None: the Engine's default, within capacity and the step budget
        device=device,
        use_graphs=MODES[args.graphs],
        seed=args.seed,
        kv_dtype=kv_dtype_option(args.kv_dtype),
        speculative=speculative_option(args, served.model),
    )
    max_seqs = engine.cache.max_seqs  # what --max-seqs auto chose, else --max-seqs
    metrics = ServerMetrics(max_seqs)
    limits = limits_from(args)
    worker = EngineWorker(engine, metrics, max_waiting=args.max_waiting, request_timeout=limits.request_timeout)
    name = args.served_model_name or args.model
    info = ModelInfo(name, served.tokenizer, capacity, served.eos_ids, limits)
    access = access_from(args, sock.getsockname()[0])
    app = build_app(worker, info, metrics, access)
    mode = ("graphs" if engine.uses_graphs else "eager") + (", overlap" if engine.overlap else "")
    mode += f", tensor parallel {tp}" if tp > 1 else ""
    text = "text and token ids" if served.tokenizer is not None else "token ids only (no tokenizer)"
    extras = f", kv {args.kv_dtype}" if args.kv_dtype != "model" else ""
    if args.speculative != "off":
        extras += f", speculative {args.speculative} (block {engine.speculator.block_size})"
    if args.prefill_budget is not None:
        extras += f", prefill budget {args.prefill_budget}"
    host, port = sock.getsockname()[:2]
    extras += ", API key required" if access.api_key else ""
    print(
        f"batchkv serve: {name} ({served.kind}, {text}) on {device} ({mode}), max_seqs {max_seqs}, "
        f"capacity {capacity}{extras}; http://{args.host}:{port}/v1",
        file=sys.stderr,
        flush=True,
    )
    if engine.sizing is not None:
        print(f"batchkv serve: sized the store: {engine.sizing.describe()}", file=sys.stderr, flush=True)
    if engine.uses_graphs:  # before it listens: no request's step waits for a capture
        seconds = engine.warm_up()
        graphs = f"batchkv serve: captured {len(engine.buckets)} step graphs in {seconds:.1f} s"
        print(graphs, file=sys.stderr, flush=True)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=args.log_level,
        access_log=args.access_log,
        timeout_graceful_shutdown=args.drain_timeout + 5.0,  # a backstop: the worker cancels first
        lifespan="on",
    )
    server = _uvicorn_server(uvicorn)(config, lambda: worker.drain(args.drain_timeout))
    previous = {sig: signal.signal(sig, _ignore) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        worker.stop()
        engine.close()  # stops the other tensor-parallel ranks
    return 0 if server.started else 1
