"""A lean streaming client for serving benchmarks: HTTP/1.1 over asyncio streams, keep-alive.

Why not httpx: it parses responses in Python (h11), and one client loop reads every stream, so on
a busy run its own parsing sat between the server's write and the read it timed (about 1 ms at the
median on the CPU stand-in, against 0.2 ms here). This client sends a prebuilt request, reads
chunked server-sent events with `readuntil`/`readexactly`, and decodes only the JSON of events.
Connections are reused LIFO and dropped after `IDLE_S` idle (uvicorn closes them after 5 s).

    records = run(port, "/v1/completions", bodies, arrivals, timeout=40.0)
    # one dict per body: index, sent, times (one per token), id, incomplete
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

IDLE_S = 2.0
ROOT = Path(__file__).resolve().parent.parent


def start_server(
    command: Callable[[int], list[str]], log: Path, timeout_s: float = 300
) -> tuple[subprocess.Popen, int]:
    """Start `command(port)` on a free local port (this checkout first on PYTHONPATH, output to
    `log`) and wait for its /health; a server that exits or does not answer within `timeout_s` is
    stopped and raises RuntimeError. Returns the process (the caller terminates it) and the port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    with open(log, "w") as out:
        proc = subprocess.Popen(command(port), stdout=out, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + timeout_s
    while True:  # bounded by the deadline
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.terminate()
            proc.wait(60)
            raise RuntimeError(f"the server did not start; see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                return proc, port
        except (urllib.error.URLError, ConnectionError):
            time.sleep(0.2)


class _Pool:
    def __init__(self, port: int) -> None:
        self.port = port
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter, float]] = []

    async def get(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bool]:
        """A connection, and whether it was reused (a reused one may have just been closed)."""
        while self.idle:
            reader, writer, since = self.idle.pop()
            if time.perf_counter() - since < IDLE_S and not reader.at_eof():
                return reader, writer, True
            writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        return reader, writer, False

    def put(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.idle.append((reader, writer, time.perf_counter()))


async def _events(reader: asyncio.StreamReader):
    """Server-sent events of a chunked response body, as bytes, until the terminating chunk."""
    buffer = b""
    while True:
        size = int((await reader.readline()).split(b";")[0], 16)
        data = await reader.readexactly(size + 2)  # the chunk and its CRLF
        if size == 0:
            return
        buffer += data[:-2]
        *events, buffer = buffer.split(b"\n\n")
        for event in events:
            yield event


async def _one(pool: _Pool, head: bytes, body: bytes, rec: dict) -> None:
    for attempt in range(2):  # a reused connection the server closed meanwhile: once more on a new one
        reader, writer, reused = await pool.get()
        rec["sent"] = time.perf_counter()
        writer.write(head + body)
        try:
            status = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()
            if reused and attempt == 0:
                continue
            raise
        break
    if not status.startswith(b"HTTP/1.1 200") or b"chunked" not in status.lower():
        writer.close()
        raise ConnectionError(f"the server answered {status.splitlines()[0]!r}")
    try:
        async for event in _events(reader):
            if not event.startswith(b"data: {"):
                continue
            now = time.perf_counter()
            chunk = json.loads(event[6:])
            if chunk.get("choices"):
                rec["times"] += [now] * len(chunk["choices"][0].get("token_ids") or ())
                rec.setdefault("id", chunk["id"])
    except BaseException:
        writer.close()  # cancelled or cut mid-response: the connection is in an unknown state
        raise
    pool.put(reader, writer)


async def _run(port: int, path: str, bodies: Sequence[bytes], arrivals: Sequence[float], timeout: float) -> list[dict]:
    pool = _Pool(port)
    heads = [f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\ncontent-type: application/json\r\n"
             f"content-length: {len(b)}\r\n\r\n".encode() for b in bodies]  # fmt: skip
    records = [{"index": i, "sent": 0.0, "times": [], "incomplete": False} for i in range(len(bodies))]
    t0 = time.perf_counter()
    for record, arrival in zip(records, arrivals, strict=True):
        record["due"] = t0 + arrival

    async def one(i: int) -> None:
        await asyncio.sleep(max(0.0, t0 + arrivals[i] - time.perf_counter()))
        try:
            await _one(pool, heads[i], bodies[i], records[i])
        except (OSError, asyncio.IncompleteReadError, ValueError):
            records[i]["incomplete"] = True

    tasks = [asyncio.ensure_future(one(i)) for i in range(len(bodies))]
    _, pending = await asyncio.wait(tasks, timeout=timeout)
    for task in pending:  # time-boxed: what is left is cancelled and counted
        task.cancel()
        records[tasks.index(task)]["incomplete"] = True
    await asyncio.gather(*tasks, return_exceptions=True)
    for _, writer, _ in pool.idle:
        writer.close()
    return records


def run(port: int, path: str, bodies: Sequence[bytes], arrivals: Sequence[float], timeout: float) -> list[dict]:
    """POST `bodies[i]` (streaming JSON) at `arrivals[i]` seconds from now; stop waiting after `timeout` s.

    Returns per body: index, due (perf_counter s it was to be sent), sent (perf_counter s, before
    its bytes went out), times (perf_counter
    s of each token read, from `token_ids`), id (the response id), incomplete (failed, cut or
    timed out). Runs its own event loop (uvloop when installed).
    """
    try:
        from uvloop import run as run_loop  # uvloop >= 0.18
    except ImportError:
        run_loop = asyncio.run
    return run_loop(_run(port, path, bodies, arrivals, timeout))
