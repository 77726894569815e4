"""What one HTTP request may ask of the server: sizes, counts, depth and time, each with a flag.

Every bound is checked before the work it bounds: the body's bytes while it is read (413 before
it is held whole), a text prompt's characters before it is tokenised, stop strings and `n` before
anything is built for them, JSON depth while the body is decoded (400, never a RecursionError's
500). Request time runs from arrival on the engine thread (`EngineWorker`), template time in the
renderer (`templates`). The defaults suit a server facing untrusted clients; the flags of
`batchkv serve` (see `options`) change them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from batchkv.serve.protocol import APIError

if TYPE_CHECKING:  # the server's options read `Limits` without the HTTP stack installed
    from starlette.requests import Request

CHARS_PER_TOKEN = 8  # a text prompt may have this many characters per token of --max-prompt-tokens


@dataclass(frozen=True)
class Limits:
    """Bounds on one request. `max_prompt_tokens` None: the capacity less one (room for one new
    token); `max_prompt_chars` None: CHARS_PER_TOKEN characters per prompt token allowed.
    `request_timeout` None: no limit (seconds from arrival to the last token)."""

    max_body_bytes: int = 16 << 20
    max_prompt_tokens: int | None = None
    max_prompt_chars: int | None = None
    max_stop_strings: int = 16
    max_stop_length: int = 256  # characters of one stop string
    max_stop_token_ids: int = 64
    max_n: int = 16
    max_json_depth: int = 32
    request_timeout: float | None = 600.0
    chat_template_timeout: float = 2.0  # seconds one chat template render may take
    trust_request_chat_template: bool = False

    def prompt_tokens(self, capacity: int) -> int:
        """Most tokens in one prompt."""
        return capacity - 1 if self.max_prompt_tokens is None else min(self.max_prompt_tokens, capacity - 1)

    def prompt_chars(self, capacity: int) -> int:
        """Most characters in one text prompt (or one conversation's contents)."""
        if self.max_prompt_chars is not None:
            return self.max_prompt_chars
        return CHARS_PER_TOKEN * max(self.prompt_tokens(capacity), 1)


def too_large(limit: int) -> APIError:
    """The 413 of a body past `limit` bytes."""
    return APIError(
        413,
        f"the request body is larger than this server accepts ({limit} bytes; the server's --max-body-bytes)",
        code="request_too_large",
    )


async def read_body(request: Request, limit: int) -> bytes:
    """The body, read chunk by chunk; APIError 413 as soon as it passes `limit` bytes (a declared
    Content-Length past it is refused before a byte is read)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)
