"""From a decoded request body to engine requests: prompts tokenised, limits checked, sampling set.

A `Job` is what one HTTP request asks for: one engine `Request` per prompt (each with n samples),
the stop strings applied to the text, and how to answer. Every refusal is an `APIError` raised
before anything reaches the engine, except those only the engine can judge (token ids outside the
vocabulary, n beyond its columns), which `Engine.submit` refuses and the worker turns into 400s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batchkv.errors import RequestError
from batchkv.executor import Request, SamplingParams
from batchkv.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest, SamplingFields


@dataclass(frozen=True)
class ModelInfo:
    """What the HTTP layer knows of the served model."""

    name: str
    tokenizer: Any | None
    capacity: int  # positions per sequence: prompt + max_tokens must fit
    eos_ids: tuple[int, ...] = ()


@dataclass
class Job:
    """One HTTP request's work: `requests[i]` continues `prompts[i]`; choices are prompt-major."""

    prompts: list[list[int]]
    requests: list[Request]
    stops: list[str]
    n: int
    stream: bool
    include_usage: bool
    token_ids: bool  # put token ids in the choices (always when there is no tokenizer)


def check_model(body: SamplingFields, info: ModelInfo) -> None:
    """APIError(404) unless the body names the served model (or none)."""
    if body.model is not None and body.model != info.name:
        raise APIError(
            404,
            f"the model {body.model!r} does not exist; this server serves {info.name!r} (see GET /v1/models)",
            param="model",
            code="model_not_found",
        )


def _need_tokenizer(info: ModelInfo, what: str, param: str):
    if info.tokenizer is None:
        raise APIError(
            400,
            f"{info.name!r} has no tokenizer (a preset, or a directory without tokenizer files), so {what} cannot "
            "be served: send the prompt as a list of token ids to /v1/completions",
            param=param,
        )
    return info.tokenizer


def completion_prompts(body: CompletionRequest, info: ModelInfo) -> list[list[int]]:
    """A string, a token-id list, or a batch of either -> one token-id list per prompt."""
    prompt = body.prompt
    if isinstance(prompt, str):
        texts: list[str] = [prompt]
    elif all(isinstance(p, int) for p in prompt) and prompt:
        return [list(prompt)]  # type: ignore[arg-type]
    elif all(isinstance(p, list) for p in prompt) and prompt:
        return [list(p) for p in prompt]  # type: ignore[arg-type,union-attr]
    elif all(isinstance(p, str) for p in prompt) and prompt:
        texts = list(prompt)  # type: ignore[arg-type]
    else:
        raise APIError(
            400,
            "prompt must be a string, a list of token ids, or a non-empty list of strings or of token-id lists "
            "(not a mix)",
            param="prompt",
        )
    tokenizer = _need_tokenizer(info, "a text prompt", "prompt")
    return [tokenizer.encode(text) for text in texts]


def _message_text(message: Any, index: int) -> str:
    content = message.content
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise APIError(
                400, f"messages[{index}] has a {part.type!r} content part; only text is served", param="messages"
            )
        parts.append(part.text)
    return "\n".join(parts)


def chat_prompt(body: ChatCompletionRequest, info: ModelInfo) -> list[int]:
    """The conversation through the tokenizer's chat template, as token ids."""
    tokenizer = _need_tokenizer(info, "chat", "messages")
    if not body.messages:
        raise APIError(400, "messages is empty; give at least one message", param="messages")
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, f"{info.name!r} has no chat template; use /v1/completions", param="messages")
    messages = [{"role": m.role, "content": _message_text(m, i)} for i, m in enumerate(body.messages)]
    try:
        text = tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=body.add_generation_prompt,
            **(body.chat_template_kwargs or {}),
        )
    except Exception as exc:  # the template raised (jinja raise_exception, bad roles, ...)
        raise APIError(400, f"the chat template refused the messages: {exc}", param="messages") from exc
    return tokenizer.encode(text, add_special_tokens=False)


def make_job(body: SamplingFields, prompts: list[list[int]], info: ModelInfo) -> Job:
    """Engine requests for `prompts` with the body's sampling fields; APIError(400) on any bad value."""
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if stops:
        _need_tokenizer(info, "stop strings", "stop")
    if body.top_k < -1:
        raise APIError(400, f"top_k is {body.top_k}; use -1 or 0 (off) or a positive integer", param="top_k")
    max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens
    # The engine also stops at its model's own EOS ids unless ignore_eos; info.eos_ids covers models
    # whose object carries none (SenseNova-U1 directories: their generation_config's).
    stop_ids = tuple(body.stop_token_ids) + (() if body.ignore_eos else info.eos_ids)
    requests = []
    for prompt in prompts:
        room = info.capacity - len(prompt)
        if room < 1 or (max_tokens is not None and max_tokens > room):
            raise APIError(
                400,
                f"this server's context length is {info.capacity} positions per sequence; the prompt has "
                f"{len(prompt)} tokens and max_tokens is {max_tokens}, {len(prompt) + (max_tokens or 1)} in all "
                f"(lower max_tokens to {max(room, 0)} or shorten the prompt)",
                param="max_tokens",
                code="context_length_exceeded",
            )
        try:
            params = SamplingParams(
                max_new_tokens=max_tokens if max_tokens is not None else room,
                temperature=body.temperature,
                top_k=max(body.top_k, 0),
                top_p=body.top_p,
                seed=body.seed,
                stop_token_ids=stop_ids,
                n=body.n,
                ignore_eos=body.ignore_eos,
            )
            requests.append(Request(prompt, params))
        except RequestError as exc:  # the message starts with the field: "top_p is 1.5", "prompt_ids[1] is -2"
            message = str(exc).replace("max_new_tokens", "max_tokens").replace("prompt_ids", "prompt")
            field = message.split(" ", 1)[0].split("[")[0]
            raise APIError(400, message, param=field if hasattr(body, field) else None) from exc
    options = body.stream_options
    return Job(
        prompts=prompts,
        requests=requests,
        stops=stops,
        n=body.n,
        stream=body.stream,
        include_usage=bool(options and options.include_usage),
        token_ids=body.return_token_ids or info.tokenizer is None,
    )
