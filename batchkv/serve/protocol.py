"""Request bodies of the OpenAI-compatible API (msgspec Structs, strict) and the errors it answers.

Bodies decode with `decode_body`: malformed JSON, a field of the wrong type and a field this
server does not know are all `APIError(400)` naming the field. OpenAI fields that batchkv does not
implement (best_of) are declared so that their default values pass and anything
else is refused by `refuse_unsupported` with the field named, rather than being silently ignored.
Extensions that vLLM also accepts: `top_k`, `stop_token_ids`, `ignore_eos`, `return_token_ids`,
`priority`, `repetition_penalty`, `min_p`, `min_tokens`, `structured_outputs` and the `guided_*`
fields (see `structured`); for chat also `add_generation_prompt`, `chat_template_kwargs` and
`chat_template` (refused unless the operator trusts request templates: see `templates`).

Free-form fields (`chat_template_kwargs`, `tools`, `tool_choice`, `response_format`) may nest no
deeper than the server's limit: deeper is a 400 naming it, as is JSON too deep to decode at all.

Errors answer `{"error": {"message", "type", "param", "code"}}` as OpenAI does.
"""

from __future__ import annotations

from typing import Any

import msgspec

from batchkv.errors import BatchKVError


class APIError(BatchKVError):
    """A refused HTTP request: `status`, and the OpenAI error body's `type`, `param` and `code`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict[str, Any]:
        """The OpenAI error JSON."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    """`stream_options`: include_usage adds a last event with `usage` and no choices."""

    include_usage: bool = False


# Fields OpenAI's API marks nullable (and vLLM's Optional extensions): an explicit null means the
# default, as both servers take it, so clients that send `"temperature": null` are served.
NULL_MEANS_DEFAULT: dict[str, Any] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "n": 1,
    "stop_token_ids": [],
    "stream": False,
    "return_token_ids": False,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_p": 0.0,
    "min_tokens": 0,
    "echo": False,
    "priority": 0,
}


class SamplingFields(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Fields shared by /v1/completions and /v1/chat/completions. Once decoded, no field that
    `NULL_MEANS_DEFAULT` names is None."""

    model: str | None = None
    max_tokens: int | None = None  # None: up to the capacity (context length)
    temperature: float | None = 1.0
    top_p: float | None = 1.0
    top_k: int | None = -1  # -1 or 0: off
    seed: int | None = None
    n: int | None = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = []
    ignore_eos: bool = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = False
    user: str | None = None
    priority: int | None = 0  # lower runs first (`batchkv.executor.Request.priority`)
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    # vLLM's sampling extensions (SamplingParams: repetition_penalty, min_p, min_tokens)
    repetition_penalty: float | None = 1.0
    min_p: float | None = 0.0
    min_tokens: int | None = 0
    # Structured outputs (`batchkv.serve.structured`): OpenAI's response_format, vLLM's fields.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's detokenizing options: special tokens' text out (False) or in, spaces between them
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True

    def __post_init__(self) -> None:
        for name, default in NULL_MEANS_DEFAULT.items():
            if getattr(self, name, default) is None:  # chat and completions declare different sets
                setattr(self, name, list(default) if isinstance(default, list) else default)


class CompletionRequest(SamplingFields, kw_only=True):
    """POST /v1/completions. `prompt`: a string, a list of token ids, or a list of either (a batch)."""

    prompt: str | list[int | str | list[int]]
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None


class ContentPart(msgspec.Struct, forbid_unknown_fields=True):
    """One part of a message's content; only `type: "text"` is served."""

    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    """One message of `messages`, handed to the chat template as {role, content}."""

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls (`tools`)
    tool_call_id: str | None = None  # a tool message's answer to that call


class ChatCompletionRequest(SamplingFields, kw_only=True):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    add_generation_prompt: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.logprobs is None:  # nullable in OpenAI's API: false
            self.logprobs = False


# field -> values that mean "off"; anything else is refused with 400 naming the field.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
}


FREE_FORM = ("chat_template_kwargs", "tools", "tool_choice", "response_format", "structured_outputs", "guided_json")


def _too_deep(limit: int) -> APIError:
    return APIError(
        400,
        f"the request body nests JSON deeper than this server accepts ({limit} levels; the server's --max-json-depth)",
        code="json_too_deep",
    )


def _depth_past(value: Any, limit: int) -> bool:
    """Whether `value` (decoded JSON) nests more than `limit` arrays/objects; iterative, stops early."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth >= limit:
                return True
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return False


def decode_body(raw: bytes, kind: type[msgspec.Struct], *, max_depth: int = 32) -> Any:
    """Decode a JSON body into `kind`; APIError(400) naming the field on any problem, and when a
    free-form field nests more than `max_depth` levels (counted from the body's top level)."""
    try:
        body = msgspec.json.decode(raw, type=kind)
    except msgspec.ValidationError as exc:
        text = str(exc)
        param = text.rsplit("at `$.", 1)[1].rstrip("`").split("[")[0].split(".")[0] if "at `$." in text else None
        if text.startswith("Object contains unknown field"):
            param = text.split("`")[1]
            where = text.rsplit(" - at `", 1)[1].rstrip("`") if " - at `" in text else "$"
            inside = "" if where == "$" else f" inside {where[2:]}"
            text = f"this server does not accept the field {param!r}{inside} (remove it)"
        raise APIError(400, text, param=param) from exc
    except msgspec.DecodeError as exc:
        raise APIError(400, f"the request body is not valid JSON ({exc})") from exc
    except RecursionError:  # deeper than the decoder goes (about 1,000 levels)
        raise _too_deep(max_depth) from None
    for name in FREE_FORM:
        if _depth_past(getattr(body, name, None), max_depth - 1):  # the body's own object is level 1
            raise _too_deep(max_depth)
    return body


def _is_off(value: Any, off: tuple[Any, ...]) -> bool:
    """`value` is one of `off`, type included (`0` must not pass as `False`, nor `0.0` as `0`)."""
    return any(value == o and type(value) is type(o) for o in off)


def refuse_unsupported(body: msgspec.Struct) -> None:
    """APIError(400) for an OpenAI field set to something batchkv does not implement."""
    for name, off in UNSUPPORTED.items():
        value = getattr(body, name, off[0])  # chat and completions declare different sets
        if not _is_off(value, off):
            raise APIError(400, f"{name}={value!r} is not supported by batchkv serve; leave it unset", param=name)
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options is only allowed with stream=true", param="stream_options")
