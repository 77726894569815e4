"""vLLM's utility endpoints: POST /tokenize, POST /detokenize and GET /version.

- /tokenize takes `{"prompt": text, "add_special_tokens": true}` or `{"messages": [...],
  "add_generation_prompt": true, ...}` (the chat template, as /v1/chat/completions renders it) and
  answers `{"count", "max_model_len", "tokens", "token_strs"}` (token_strs only with
  `return_token_strs`).
- /detokenize takes `{"tokens": [ids]}` and answers `{"prompt": text}`.
- /version answers `{"version": batchkv's}`.

Bodies are strict msgspec Structs (an unknown field is a 400 naming it); limits are the server's
(body size, prompt characters); tokenising runs on a worker thread, never on the event loop.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from starlette.responses import Response

from batchkv import __version__
from batchkv.serve import jobs
from batchkv.serve.limits import read_body
from batchkv.serve.protocol import APIError, ChatCompletionRequest, ChatMessage, decode_body


class TokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """POST /tokenize: a prompt, or chat messages rendered through the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """POST /detokenize: token ids back to text."""

    model: str | None = None
    tokens: list[int]


def _json(body: Any) -> Response:
    return Response(msgspec.json.encode(body), media_type="application/json")


def tokenize(body: TokenizeRequest, info: jobs.ModelInfo) -> dict[str, Any]:
    """The answer of POST /tokenize; APIError(400) naming the field on a bad body."""
    jobs.check_model(body, info)  # type: ignore[arg-type]
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give either prompt (text) or messages (a chat), not both or neither", param="prompt")
    if body.messages is not None:
        chat = ChatCompletionRequest(
            messages=body.messages,
            add_generation_prompt=body.add_generation_prompt,
            chat_template=body.chat_template,
            chat_template_kwargs=body.chat_template_kwargs,
        )
        ids = jobs.chat_prompt(chat, info)
    else:
        tokenizer = jobs._need_tokenizer(info, "tokenize", "prompt")
        jobs._check_chars(len(body.prompt or ""), info.limits.prompt_chars(info.capacity), "prompt")
        ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    strs = info.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": info.capacity, "tokens": ids, "token_strs": strs}


def detokenize(body: DetokenizeRequest, info: jobs.ModelInfo) -> dict[str, Any]:
    """The answer of POST /detokenize; APIError(400) naming `tokens` for an id outside the vocabulary."""
    jobs.check_model(body, info)  # type: ignore[arg-type]
    tokenizer = jobs._need_tokenizer(info, "detokenize", "tokens")
    vocab = len(tokenizer)
    bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is outside the tokenizer's vocabulary [0, {vocab})", param="tokens")
    return {"prompt": tokenizer.decode(body.tokens)}


def add_routes(app: FastAPI, info: jobs.ModelInfo) -> None:
    """Add /tokenize, /detokenize and /version to `app`."""
    limits = info.limits

    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> Response:
        raw = await read_body(request, limits.max_body_bytes)

        def work() -> dict[str, Any]:
            return tokenize(decode_body(raw, TokenizeRequest, max_depth=limits.max_json_depth), info)

        return _json(await asyncio.to_thread(work))

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> Response:
        raw = await read_body(request, limits.max_body_bytes)

        def work() -> dict[str, Any]:
            return detokenize(decode_body(raw, DetokenizeRequest, max_depth=limits.max_json_depth), info)

        return _json(await asyncio.to_thread(work))

    @app.get("/version")
    async def version() -> Response:
        return _json({"version": __version__})
