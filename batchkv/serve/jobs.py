"""From a decoded request body to engine requests: prompts tokenised, limits checked, sampling set.

A `Job` is what one HTTP request asks for: one engine `Request` per prompt (each with n samples),
the stop strings applied to the text (one automaton for all its choices), and how to answer.
Every refusal is an `APIError` raised before anything reaches the engine, except those only the
engine can judge (n beyond the store's room), which `Engine.submit` refuses and the worker turns
into 400s. The `Limits` of `info` are checked before the work they
bound: a text prompt's characters before it is tokenised, the number of stop strings before the
automaton is built. These functions run on a worker thread (`app`), never on the event loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from batchkv.errors import RequestError
from batchkv.executor import Request, SamplingParams
from batchkv.serve import structured, templates
from batchkv.serve import tools as tools_module
from batchkv.serve.detok import StopStrings
from batchkv.serve.limits import Limits
from batchkv.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest, SamplingFields


@dataclass(frozen=True)
class ModelInfo:
    """What the HTTP layer knows of the served model."""

    name: str
    tokenizer: Any | None
    capacity: int  # positions per sequence: prompt + max_tokens must fit
    eos_ids: tuple[int, ...] = ()
    limits: Limits = field(default_factory=Limits)
    tool_parser: str | None = None  # --tool-call-parser; None: from the chat template
    vocab_size: int | None = None  # token ids lie in [0, vocab_size); None: int32's range


def check_ids(ids: list[int], info: ModelInfo, what: str, param: str) -> None:
    """APIError(400) naming the first id outside [0, vocab) (2**63 included: never a 500)."""
    vocab = info.vocab_size or 2**31
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(400, f"{what} {bad} is outside the vocabulary [0, {vocab})", param=param)


@dataclass
class Job:
    """One HTTP request's work: `requests[i]` continues `prompts[i]`; choices are prompt-major."""

    prompts: list[list[int]]
    requests: list[Request]
    stops: StopStrings
    n: int
    stream: bool
    include_usage: bool
    token_ids: bool  # put token ids in the choices (always when there is no tokenizer)
    logprobs: int | None = None  # alternatives per token when the answer carries logprobs, else None
    tools: tools_module.ToolPlan | None = None  # chat with tools: how the answers are parsed
    skip_special_tokens: bool = True  # the detokenizer's options (vLLM's)
    spaces_between_special_tokens: bool = True
    echo: list[str] | None = None  # completions' echo: each prompt's text, put before its choices' text


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


def prompt_count(body: SamplingFields) -> int:
    """How many prompts (engine requests) a body holds, before anything is tokenised."""
    prompt = getattr(body, "prompt", None)
    if isinstance(prompt, list) and prompt and not all(isinstance(p, int) for p in prompt):
        return len(prompt)
    return 1


def completion_prompts(body: CompletionRequest, info: ModelInfo) -> list[list[int]]:
    """A string, a token-id list, or a batch of either -> one token-id list per prompt."""
    prompt = body.prompt
    if isinstance(prompt, str):
        texts: list[str] = [prompt]
    elif all(isinstance(p, int) for p in prompt) and prompt:
        check_ids(prompt, info, "prompt token id", "prompt")  # type: ignore[arg-type]
        return [list(prompt)]  # type: ignore[arg-type]
    elif all(isinstance(p, list) for p in prompt) and prompt:
        for ids in prompt:
            check_ids(ids, info, "prompt token id", "prompt")  # type: ignore[arg-type]
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
    limit = info.limits.prompt_chars(info.capacity)
    for text in texts:
        _check_chars(len(text), limit, "prompt")
    return [tokenizer.encode(text) for text in texts]


def _check_chars(chars: int, limit: int, param: str) -> None:
    if chars > limit:
        raise APIError(
            400,
            f"the prompt has {chars} characters; this server tokenises at most {limit} per prompt (the server's "
            "--max-prompt-chars): shorten it",
            param=param,
            code="context_length_exceeded",
        )


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
    """The conversation through the chat template (see `templates`), as token ids."""
    tokenizer = _need_tokenizer(info, "chat", "messages")
    if not body.messages:
        raise APIError(400, "messages is empty; give at least one message", param="messages")
    if not getattr(tokenizer, "chat_template", None) and templates.requested(body) is None:
        raise APIError(400, f"{info.name!r} has no chat template; use /v1/completions", param="messages")
    messages = [{"role": m.role, "content": _message_text(m, i)} for i, m in enumerate(body.messages)]
    plan = tools_module.plan(body.tools, body.tool_choice, tokenizer, info.tool_parser)
    messages = tools_module.template_messages(messages, body.messages)
    limits = info.limits
    limit = limits.prompt_chars(info.capacity)
    _check_chars(sum(len(m["content"]) + len(m["role"]) for m in messages), limit, "messages")  # before rendering
    trusted, seconds = limits.trust_request_chat_template, limits.chat_template_timeout
    text = templates.render(
        tokenizer, messages, body, trusted=trusted, seconds=seconds, tools=plan.tools if plan is not None else None
    )
    _check_chars(len(text), limit, "messages")  # the template's own text counts too
    return tokenizer.encode(text, add_special_tokens=False)


def _stops(body: SamplingFields, limits: Limits) -> list[str]:
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stops) > limits.max_stop_strings:
        raise APIError(
            400,
            f"stop has {len(stops)} strings; this server takes at most {limits.max_stop_strings} (the server's "
            "--max-stop-strings)",
            param="stop",
        )
    longest = max((len(s) for s in stops), default=0)
    if longest > limits.max_stop_length:
        raise APIError(
            400,
            f"a stop string has {longest} characters; this server takes at most {limits.max_stop_length} (the "
            "server's --max-stop-length)",
            param="stop",
        )
    if len(body.stop_token_ids) > limits.max_stop_token_ids:
        raise APIError(
            400,
            f"stop_token_ids has {len(body.stop_token_ids)} ids; this server takes at most "
            f"{limits.max_stop_token_ids} (the server's --max-stop-token-ids)",
            param="stop_token_ids",
        )
    return stops


def _max_tokens(body: SamplingFields) -> int | None:
    """max_completion_tokens (chat's newer name) before max_tokens; an explicit 0 is refused, not unset."""
    completion = getattr(body, "max_completion_tokens", None)
    name, value = ("max_completion_tokens", completion) if completion is not None else ("max_tokens", body.max_tokens)
    if value is not None and value < 1:
        raise APIError(400, f"{name} is {value}; ask for at least 1 token (or leave it unset)", param=name)
    return value


MAX_COMPLETION_LOGPROBS = 5  # the completions API's `logprobs` bound (OpenAI's)
MAX_TOP_LOGPROBS = 20  # chat's `top_logprobs` bound (OpenAI's)


def logprobs_asked(body: SamplingFields) -> int | None:
    """Alternatives per token the body asks for (completions' `logprobs`, chat's `top_logprobs`
    with `logprobs: true`), or None; APIError(400) past OpenAI's bounds."""
    if isinstance(body, CompletionRequest):
        k, most, name = body.logprobs, MAX_COMPLETION_LOGPROBS, "logprobs"
    else:
        k, most, name = body.top_logprobs, MAX_TOP_LOGPROBS, "top_logprobs"  # type: ignore[attr-defined]
        if not body.logprobs:  # type: ignore[attr-defined]
            if k:
                raise APIError(400, f"top_logprobs is {k}; it needs logprobs: true (or leave it unset)", param=name)
            return None
        k = k or 0
    if k is not None and not 0 <= k <= most:
        raise APIError(400, f"{name} is {k}; it must lie in [0, {most}] (or leave it unset)", param=name)
    return k


def make_job(body: SamplingFields, prompts: list[list[int]], info: ModelInfo) -> Job:
    """Engine requests for `prompts` with the body's sampling fields; APIError(400) on any bad value."""
    limits = info.limits
    stops = _stops(body, limits)
    if stops:
        _need_tokenizer(info, "stop strings", "stop")
    if body.top_k < -1:
        raise APIError(400, f"top_k is {body.top_k}; use -1 or 0 (off) or a positive integer", param="top_k")
    if not 1 <= body.n <= limits.max_n:
        raise APIError(400, f"n is {body.n}; this server takes n in [1, {limits.max_n}] (the server's --max-n, at most "
                       "its --max-seqs)",
                       param="n")  # fmt: skip
    check_ids(body.stop_token_ids, info, "stop_token_ids holds", "stop_token_ids")
    max_tokens = _max_tokens(body)
    logprobs = logprobs_asked(body)
    # The engine also stops at its model's own EOS ids unless ignore_eos; info.eos_ids covers models
    # whose object carries none (SenseNova-U1 directories: their generation_config's).
    stop_ids = tuple(body.stop_token_ids) + (() if body.ignore_eos else info.eos_ids)
    bias, constraint = structured.logit_bias(body.logit_bias), structured.constraint_of(body)
    plan = None
    if isinstance(body, ChatCompletionRequest):
        plan = tools_module.plan(body.tools, body.tool_choice, info.tokenizer, info.tool_parser)
    if plan is not None and plan.constraint is not None:
        if constraint is not None:
            raise APIError(400, f"tool_choice {plan.choice!r} and {constraint.field} both constrain the output; "
                           "set one", param="tool_choice")  # fmt: skip
        constraint = plan.constraint
    most = limits.prompt_tokens(info.capacity)
    requests = []
    for prompt in prompts:
        room = _room(body, prompt, most, info.capacity, max_tokens)
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
                logprobs=logprobs,
                presence_penalty=body.presence_penalty,
                frequency_penalty=body.frequency_penalty,
                repetition_penalty=body.repetition_penalty,
                min_p=body.min_p,
                min_tokens=body.min_tokens,
                logit_bias=bias,
                constraint=constraint,
            )
            requests.append(Request(prompt, params, priority=body.priority))
        except RequestError as exc:  # the message starts with the field: "top_p is 1.5", "prompt_ids[1] is -2"
            message = str(exc).replace("max_new_tokens", "max_tokens").replace("prompt_ids", "prompt")
            field = message.split(" ", 1)[0].split("[")[0]
            raise APIError(400, message, param=field if hasattr(body, field) else None) from exc
    options = body.stream_options
    return Job(
        prompts=prompts,
        requests=requests,
        stops=StopStrings(stops),
        n=body.n,
        stream=body.stream,
        include_usage=bool(options and options.include_usage),
        token_ids=body.return_token_ids or info.tokenizer is None,
        logprobs=logprobs,
        tools=plan,
        skip_special_tokens=body.skip_special_tokens,
        spaces_between_special_tokens=body.spaces_between_special_tokens,
        echo=_echo(body, prompts, info, logprobs),
    )


def _room(body: SamplingFields, prompt: list[int], most: int, capacity: int, max_tokens: int | None) -> int:
    """Positions left after `prompt` (max_new_tokens when max_tokens is unset); APIError(400,
    context_length_exceeded) for a prompt over the server's `most` or one that leaves no room."""
    if len(prompt) > most:
        raise APIError(
            400,
            f"the prompt has {len(prompt)} tokens; this server takes at most {most} per prompt (the server's "
            "--max-prompt-tokens and --capacity): shorten it",
            param="prompt" if isinstance(body, CompletionRequest) else "messages",
            code="context_length_exceeded",
        )
    room = capacity - len(prompt)
    if room < 1 or (max_tokens is not None and max_tokens > room):
        raise APIError(
            400,
            f"this server's context length is {capacity} positions per sequence; the prompt has "
            f"{len(prompt)} tokens and max_tokens is {max_tokens}, {len(prompt) + (max_tokens or 1)} in all "
            f"(lower max_tokens to {max(room, 0)} or shorten the prompt)",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return room


def _echo(body: SamplingFields, prompts: list[list[int]], info: ModelInfo, logprobs: int | None) -> list[str] | None:
    """Completions' `echo`: each prompt's text (decoded as the answer is), or None when not asked."""
    if not getattr(body, "echo", False):
        return None
    if logprobs is not None:
        raise APIError(400, "echo with logprobs (the prompt's logprobs) is not supported; drop one", param="echo")
    tokenizer = _need_tokenizer(info, "echo", "echo")
    options = {"skip_special_tokens": body.skip_special_tokens, "clean_up_tokenization_spaces": False}
    return [tokenizer.decode(prompt, **options) for prompt in prompts]
