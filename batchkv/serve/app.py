"""The HTTP face: FastAPI routes over an `EngineWorker`.

Routes: POST /v1/completions, POST /v1/chat/completions (both streamed as server-sent events with
`stream: true`: `data: {json}` per wake of the stream's reader, each choice's tokens since the last
one merged, then `data: [DONE]`), GET /v1/models, GET /health,
GET /metrics (Prometheus text), and vLLM's POST /tokenize, POST /detokenize and GET /version
(`tokens`). `Guard` (see `guard`) checks the Host, the API key and the
Content-Type first and marks every answer with `x-request-id`. A body is read up to the limit
(413 past it), then decoded with msgspec (see `protocol`), tokenised and templated on a worker
thread, so the event loop (and /health, and every other stream) never waits on one request's
preparation. Answers are encoded with msgspec. Every refusal is an OpenAI-style JSON error with
its status; unexpected failures are 500s of the same shape that name the request id, not the
exception. A client that disconnects, streamed or not, cancels its request: the handler is
cancelled and the tracker's cleanup posts the cancel to the engine thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from batchkv.serve import jobs, outputs, structured, tokens
from batchkv.serve.guard import REQUEST_ID, Access, Guard, internal_error
from batchkv.serve.limits import read_body
from batchkv.serve.metrics import ServerMetrics
from batchkv.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest, decode_body, refuse_unsupported
from batchkv.serve.worker import EngineWorker

log = logging.getLogger("batchkv.serve")


def _json(body: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(body), status_code=status, media_type="application/json")


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class EventStream(StreamingResponse):
    """Server-sent events from an async iterator of bytes; a disconnect cancels the iterator
    (whatever the ASGI version: Starlette's own only notices one at the next write on ASGI 2.4)."""

    def __init__(self, chunks: AsyncIterator[bytes]) -> None:
        headers = {"cache-control": "no-cache", "x-accel-buffering": "no"}
        super().__init__(chunks, media_type="text/event-stream", headers=headers)
        self.chunks = chunks

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def produce() -> None:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async with contextlib.aclosing(self.chunks) as chunks:
                async for chunk in chunks:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        await _race(produce(), receive)


async def _race(work: Awaitable[Any], receive: Receive) -> Any:
    """Run `work` until it ends or the client disconnects (then `work` is cancelled; returns None)."""
    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(_until_disconnect(receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watch):
            t.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)
    return task.result() if not task.cancelled() else None


def _sse(body: Any) -> bytes:
    return b"data: " + msgspec.json.encode(body) + b"\n\n"


def build_app(
    worker: EngineWorker, info: jobs.ModelInfo, metrics: ServerMetrics, access: Access | None = None
) -> FastAPI:
    """The FastAPI application. The worker's thread starts and stops with the app's lifespan;
    `info.limits` bound each request, `access` (default: open, any Host) says who may ask."""
    app = FastAPI(title="batchkv", lifespan=_lifespan(worker), docs_url=None, redoc_url=None, openapi_url=None)
    _guard(app, access or Access(), metrics)
    _error_handlers(app, metrics)
    _info_routes(app, worker, info, metrics)
    limits = info.limits
    tokens.add_routes(app, info)  # /tokenize, /detokenize, /version (vLLM's)

    async def generate(
        request: Request,
        kind: type,
        prompts: Callable[[Any], list[list[int]]],
        render: Callable[..., dict],
        chunk: Callable[..., dict],
        prefix: str,
    ) -> Response:
        arrival = time.perf_counter()
        raw = await read_body(request, limits.max_body_bytes)

        def prepare() -> outputs.Tracker:  # on a worker thread: decoding, templating, tokenising
            body = decode_body(raw, kind, max_depth=limits.max_json_depth)
            jobs.check_model(body, info)
            refuse_unsupported(body)
            worker.refuse_batch(jobs.prompt_count(body))
            job = jobs.make_job(body, prompts(body), info)
            constraint = job.requests[0].params.constraint if job.requests else None
            if constraint is not None:  # compiled here, off the loop and the engine thread (then cached)
                if hasattr(worker, "compile_constraint"):  # where the engine runs: this process or its own
                    worker.compile_constraint(constraint)
                else:
                    structured.compile_constraint(worker.engine, constraint)
            return outputs.Tracker(job, info.tokenizer, lambda reason: metrics.finished.labels(reason).inc())

        tracker = await asyncio.to_thread(prepare)
        job = tracker.job
        if getattr(worker, "feeds_trackers", False):  # EngineWorker: its thread detokenises, per step
            stream = await worker.submit(job.requests, arrival, tracker)
        else:  # a worker of raw events (Ray's frontend): the tracker is fed here, on the loop
            stream = await worker.submit(job.requests, arrival)
        rid, model = outputs.new_id(prefix), info.name
        if job.stream:
            return EventStream(_chunks(tracker, stream, rid, model, chunk, chat=prefix == "chatcmpl"))

        async def collect() -> None:
            async with contextlib.aclosing(tracker.deltas(stream)) as deltas:
                async for _ in deltas:
                    pass

        await _race(collect(), request.receive)
        if not tracker.done:  # the client went away; nobody reads this
            return Response(status_code=499)
        return _json(render(tracker, rid, model))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(
            request,
            CompletionRequest,
            lambda b: jobs.completion_prompts(b, info),
            outputs.completion_body,
            outputs.completion_chunk,
            "cmpl",
        )

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await generate(
            request,
            ChatCompletionRequest,
            lambda b: [jobs.chat_prompt(b, info)],
            outputs.chat_body,
            outputs.chat_chunk,
            "chatcmpl",
        )

    return app


def _lifespan(worker: EngineWorker) -> Callable[[FastAPI], contextlib.AbstractAsyncContextManager[None]]:
    """The app's lifespan: the worker's thread starts with the app and stops with it."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        worker.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            worker.stop()

    return lifespan


def _guard(app: FastAPI, access: Access, metrics: ServerMetrics) -> None:
    """Who may ask: the key and Host checks (refusals counted), and CORS where origins are allowed."""
    app.add_middleware(Guard, access=access, count=lambda status: metrics.refused.labels(str(status)).inc())
    if access.allowed_origins:  # added last, so outermost: preflights are answered before the key is asked
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(access.allowed_origins),
            allow_methods=["GET", "POST", "OPTIONS"],
            allow_headers=["authorization", "content-type", "x-request-id"],
            expose_headers=["x-request-id"],
        )


def _error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    """Every refusal as OpenAI's error body: ours (APIError), a route not found, a body that does
    not match a route's parameters."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> Response:
        metrics.refused.labels(str(exc.status)).inc()
        log.info("request %s refused (%d): %s", REQUEST_ID.get(), exc.status, exc.message)
        return _json(exc.body(), exc.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _json(APIError(exc.status_code, str(exc.detail), type=kind).body(), exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        log.info("request %s refused (400): %s", REQUEST_ID.get(), exc)
        return _json(APIError(400, "the request does not match this route's parameters").body(), 400)


def _info_routes(app: FastAPI, worker: EngineWorker, info: jobs.ModelInfo, metrics: ServerMetrics) -> None:
    """The routes that generate nothing: /health, /metrics, /v1/models."""

    @app.get("/health")
    async def health() -> Response:
        if not worker.alive:
            return _json(APIError(503, "the engine has stopped", type="server_error").body(), 503)
        return _json({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models() -> Response:
        card = {"id": info.name, "object": "model", "created": 0, "owned_by": "batchkv", "max_model_len": info.capacity}
        return _json({"object": "list", "data": [card]})


async def _chunks(
    tracker: outputs.Tracker, stream, rid: str, model: str, chunk: Callable[..., dict], *, chat: bool
) -> AsyncIterator[bytes]:
    job, created = tracker.job, int(time.time())
    if chat:  # the role first, as OpenAI does
        first = [{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None} for c in tracker.choices]  # fmt: skip
        yield _sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": first})
    try:
        async with contextlib.aclosing(tracker.deltas(stream)) as steps:
            async for deltas in steps:
                shown = [d for d in deltas if d.text or d.finish or job.token_ids or d.logprobs]
                if shown:
                    yield _sse(chunk(tracker, shown, rid, model, created))
    except Exception:  # the engine failed mid-stream: say so in the stream, the detail in the log
        log.exception("request %s failed mid-stream", REQUEST_ID.get())
        yield _sse(internal_error(REQUEST_ID.get()).body())
    if job.include_usage:
        object_ = "chat.completion.chunk" if chat else "text_completion"
        yield _sse({"id": rid, "object": object_, "created": created, "model": model, "choices": [],
                    "usage": tracker.usage()})  # fmt: skip
    yield b"data: [DONE]\n\n"
