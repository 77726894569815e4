"""The server around an engine: start the engine thread (`run`, over an engine built here) or take a
launched engine process (`serve`, over a `process.ProcessWorker`), run uvicorn, shut down cleanly
(`batchkv.cli.serve` parses the options and builds the engine or has its process build it).

Shutdown on SIGINT or SIGTERM: uvicorn stops accepting connections; requests in flight may finish
for `--drain-timeout` seconds, then the engine thread cancels the rest (their streams end with
finish_reason "abort", their columns are freed) and new submits get 503. Then the engine thread
stops and the process exits 0. A second SIGINT forces the exit.
"""

from __future__ import annotations

import signal
import socket
import sys

from batchkv.errors import ConfigError, DependencyError
from batchkv.serve.access import Access
from batchkv.serve.jobs import ModelInfo

__all__ = ["listen", "require_extra", "run", "serve"]


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


def require_extra() -> None:
    """DependencyError naming the extra unless FastAPI, uvicorn and prometheus-client import."""
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise DependencyError(f"batchkv serve needs its extra ({exc}): pip install 'batchkv[serve]'") from exc


def listen(host: str, port: int) -> socket.socket:
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


def warm(engine) -> None:
    """Before the engine serves: every width's graph captured (no request's step waits for a capture,
    the count and seconds on stderr), then the heap frozen, since the process serves until it exits
    (`freeze_heap`: no full pass of the cycle collector walks the model in a step)."""
    from batchkv.executor.graphs import freeze_heap

    if engine.uses_graphs:
        seconds = engine.warm_up()
        graphs = f"batchkv serve: captured {engine.runner.captures} step graphs in {seconds:.1f} s"
        print(graphs, file=sys.stderr, flush=True)
    freeze_heap()


def run(
    engine,
    info: ModelInfo,
    access: Access,
    sock: socket.socket,
    *,
    max_waiting: int,
    drain_timeout: float,
    log_level: str = "info",
    access_log: bool = False,
) -> int:
    """Serve `engine` on the bound `sock` from a thread of this process until a signal stops the
    server; returns the exit status. The engine thread stops here; the caller closes the engine."""
    from batchkv.serve.metrics import ServerMetrics
    from batchkv.serve.worker import EngineWorker

    metrics = ServerMetrics(engine.cache.max_seqs)
    worker = EngineWorker(engine, metrics, max_waiting=max_waiting, request_timeout=info.limits.request_timeout)
    warm(engine)
    return serve(worker, info, metrics, access, sock, drain_timeout=drain_timeout, log_level=log_level,
                 access_log=access_log)  # fmt: skip


def serve(
    worker,
    info: ModelInfo,
    metrics,
    access: Access,
    sock: socket.socket,
    *,
    drain_timeout: float,
    log_level: str = "info",
    access_log: bool = False,
) -> int:
    """Serve the app over `worker` (an `EngineWorker`, or a launched `ProcessWorker`) on `sock` until a
    signal stops the server; returns the exit status. The worker stops here."""
    import uvicorn

    from batchkv.serve.app import build_app

    app = build_app(worker, info, metrics, access)
    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=access_log,
        timeout_graceful_shutdown=drain_timeout + 5.0,  # a backstop: the worker cancels first
        lifespan="on",
    )
    server = _uvicorn_server(uvicorn)(config, lambda: worker.drain(drain_timeout))
    previous = {sig: signal.signal(sig, _ignore) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        worker.stop()
    return 0 if server.started else 1
