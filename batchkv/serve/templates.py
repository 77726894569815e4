"""Chat templates: the conversation through the tokenizer's template, sandboxed and timed.

transformers renders chat templates in jinja2's `ImmutableSandboxedEnvironment` (no attribute
access to internals, no mutation of the messages). On top of that:
- A template a request supplies (the `chat_template` field, or `chat_template` inside
  `chat_template_kwargs`) is refused unless the operator passed `--trust-request-chat-template`
  (vLLM's rule since GHSA-6fvq-23cw-5628): a template is a program, and a client's would run on
  the server.
- `chat_template_kwargs` are template variables only: a key that names a parameter of
  `apply_chat_template` (tokenize, return_dict, tools, ...) would change the call, not the
  template, and is refused.
- Every render, trusted template or not, runs on a thread of its own with a time budget
  (`--chat-template-timeout`): past it, an exception is raised in that thread at its next
  bytecode (a template's loops are Python bytecode) and the request gets a 400. The budget
  bounds CPU time, not memory: a trusted request template can still build a large string.
"""

from __future__ import annotations

import ctypes
import inspect
import logging
import threading
from collections.abc import Callable
from typing import Any

import jinja2

from batchkv.serve.protocol import APIError, ChatCompletionRequest

log = logging.getLogger("batchkv.serve")
_SET_ASYNC_EXC = ctypes.pythonapi.PyThreadState_SetAsyncExc


class RenderTimeout(Exception):
    """Raised inside a render thread that ran past its budget."""


def call_with_budget(fn: Callable[[], Any], seconds: float) -> Any:
    """`fn()` on a thread of its own; RenderTimeout once it runs `seconds` (it is interrupted at its
    next Python bytecode; a long C call finishes first, on its thread, unanswered)."""
    box: dict[str, Any] = {}
    lock = threading.Lock()  # the caller sets the exception only while `done` is unset, under it

    def run() -> None:
        me = ctypes.c_ulong(threading.get_ident())
        try:
            try:
                box["value"] = fn()
            except BaseException as exc:  # handed to the caller, as raised
                box["error"] = exc
            finally:
                with lock:
                    box["done"] = True
                    _SET_ASYNC_EXC(me, None)  # one set just before `done` must not outlive the render
        except RenderTimeout:
            pass  # it arrived after fn returned: nobody waits for this thread

    thread = threading.Thread(target=run, name="batchkv-template", daemon=True)
    thread.start()
    thread.join(seconds)
    with lock:
        if not box.get("done"):
            _SET_ASYNC_EXC(ctypes.c_ulong(thread.ident), ctypes.py_object(RenderTimeout))
            raise RenderTimeout(f"past {seconds} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def _call_parameters(tokenizer: Any) -> frozenset[str]:
    """The named parameters of the tokenizer's apply_chat_template (not template variables)."""
    params = inspect.signature(tokenizer.apply_chat_template).parameters.values()
    return frozenset(p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))


def requested(body: ChatCompletionRequest) -> Any:
    """The template a request brings (its `chat_template` field, else one in chat_template_kwargs), or None."""
    if body.chat_template is not None:
        return body.chat_template
    return (body.chat_template_kwargs or {}).get("chat_template")


def template_arguments(body: ChatCompletionRequest, tokenizer: Any, *, trusted: bool) -> dict[str, Any]:
    """The keywords for apply_chat_template beyond the messages: the template variables of
    `chat_template_kwargs` and, when trusted, a request's own template. APIError(400) otherwise."""
    kwargs = dict(body.chat_template_kwargs or {})
    kwargs.pop("chat_template", None)
    template = requested(body)
    param = "chat_template" if body.chat_template is not None else "chat_template_kwargs"
    if template is not None and not trusted:
        raise APIError(
            400,
            "request-supplied chat templates are refused: this server renders its model's own template "
            "(the operator may allow them with --trust-request-chat-template)",
            param=param,
        )
    if template is not None and not isinstance(template, str):
        raise APIError(400, "chat_template must be a string (a jinja template)", param=param)
    reserved = sorted(_call_parameters(tokenizer) & kwargs.keys())
    if reserved:
        raise APIError(
            400,
            f"chat_template_kwargs may set template variables only; {', '.join(reserved)} is a parameter of "
            "the template call (remove it)",
            param="chat_template_kwargs",
        )
    return {**kwargs, **({"chat_template": template} if template is not None else {})}


def render(
    tokenizer: Any,
    messages: list[dict],
    body: ChatCompletionRequest,
    *,
    trusted: bool,
    seconds: float,
    tools: list[dict] | None = None,
) -> str:
    """The conversation as the prompt text; APIError(400) when the template refuses it, fails, or
    runs past `seconds`. `tools`: the function tools for the template's own tools support."""
    kwargs = template_arguments(body, tokenizer, trusted=trusted)
    if tools:
        kwargs["tools"] = tools

    def apply() -> str:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=body.add_generation_prompt, **kwargs
        )

    try:
        text = call_with_budget(apply, seconds)
    except RenderTimeout:
        raise APIError(
            400,
            f"the chat template took longer than {seconds} s to render these messages (the server's "
            "--chat-template-timeout)",
            param="messages",
            code="template_timeout",
        ) from None
    except jinja2.TemplateError as exc:  # raise_exception, a sandbox refusal, an undefined name, bad syntax
        raise APIError(400, f"the chat template refused the messages: {exc}", param="messages") from exc
    except Exception as exc:  # a template that failed some other way: the detail stays in the log
        log.warning("chat template failed: %s: %s", type(exc).__name__, exc)
        raise APIError(400, "the chat template failed on these messages", param="messages") from exc
    if not isinstance(text, str):
        raise APIError(400, "the chat template did not render text", param="messages")
    return text
