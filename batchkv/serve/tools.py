"""Tool calls in /v1/chat/completions: `tools` and `tool_choice` in, `message.tool_calls` out.

- The tools reach the model through its chat template's own `tools` support (transformers'
  `apply_chat_template(tools=...)`); `tool_choice: "none"` leaves them out. History may hold
  assistant messages with `tool_calls` (their JSON `arguments` handed to the template as objects)
  and `tool` messages with `tool_call_id`.
- The model's output is parsed by the parser of its template's format: `hermes`
  (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, Qwen2.5/Qwen3 and many fine-tunes),
  `llama3_json` (a JSON object `{"name": ..., "parameters": {...}}`, optionally after
  `<|python_tag|>`), `mistral` (`[TOOL_CALLS] [{"name": ..., "arguments": {...}}]`), chosen from the
  template text or by `--tool-call-parser NAME` (vLLM's flag).
- `tool_choice: "required"` and a named function are enforced by a JSON-schema constraint (vLLM's
  way): required makes the output a JSON array of `{"name", "arguments"}` calls of the given tools,
  a named function makes it that function's arguments object; either always parses.
- A choice with calls answers `finish_reason: "tool_calls"`. A call's `arguments` is the JSON text
  the model wrote for them (not re-serialised), so a streamed call's fragments concatenate to it.
- Streamed (`tool_stream.ToolStream`, one per choice), calls go out as OpenAI streams them, incrementally over
  the model's text: text before a call as `delta.content` (a possible start of the call marker and
  trailing whitespace held back until the next text tells), then per call a first
  `delta.tool_calls[i]` with its index, id, type, name and empty arguments, then `arguments`
  fragments as the model writes them; the markup itself never reaches `delta.content`. Hermes,
  Mistral and the constrained `required`/named outputs stream this way; a call whose name does not
  come first (or a Llama 3 JSON answer, which is a call only if all of it is) goes out whole when
  its block or the choice ends. A call cut off by `max_tokens` has streamed as far as it got.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from batchkv.errors import ConfigError
from batchkv.executor.constraints import Constraint
from batchkv.serve.protocol import APIError

PARSERS = ("hermes", "llama3_json", "mistral")
MAX_TOOLS = 128


@dataclass(frozen=True)
class ToolPlan:
    """How one request uses tools: the tools for the template, the choice, and how to parse."""

    tools: list[dict[str, Any]]
    choice: str  # "auto", "required" or the named function
    parser: str  # one of PARSERS, or "forced" / "named" when a constraint shapes the output
    constraint: Constraint | None = None


def check_parser(name: str | None) -> str | None:
    """`--tool-call-parser`: None (from the template) or one of PARSERS; ConfigError otherwise."""
    if name is not None and name not in PARSERS:
        raise ConfigError(f"--tool-call-parser {name!r} is not one of {', '.join(PARSERS)}")
    return name


def detect(tokenizer: Any) -> str:
    """The parser for the tokenizer's chat template: Mistral's, Llama 3's, else Hermes'."""
    template = str(getattr(tokenizer, "chat_template", "") or "")
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return "hermes"


def _function(tool: Any, index: int) -> dict[str, Any]:
    if (
        not isinstance(tool, dict)
        or tool.get("type", "function") != "function"
        or not isinstance(tool.get("function"), dict)
    ):
        raise APIError(400, f"tools[{index}] must be {{'type': 'function', 'function': {{...}}}}", param="tools")
    fn = tool["function"]
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise APIError(400, f"tools[{index}].function needs a name", param="tools")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict):
        raise APIError(400, f"tools[{index}].function.parameters must be a JSON schema object", param="tools")
    return fn


def plan(tools: list[Any] | None, tool_choice: Any, tokenizer: Any, parser: str | None) -> ToolPlan | None:
    """The request's `ToolPlan`, or None when it uses no tools; APIError(400) naming the field."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return None
    if len(tools) > MAX_TOOLS:
        raise APIError(400, f"tools has {len(tools)} entries; at most {MAX_TOOLS}", param="tools")
    functions = [_function(tool, i) for i, tool in enumerate(tools)]
    names = [fn["name"] for fn in functions]
    if tool_choice in (None, "auto"):
        choice = "auto"
    elif tool_choice == "none":
        return None
    elif tool_choice == "required":
        choice = "required"
    elif isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict):
        choice = tool_choice["function"].get("name")
        if choice not in names:
            raise APIError(400, f"tool_choice names {choice!r}, which is not among the tools", param="tool_choice")
    else:
        raise APIError(400, "tool_choice is none, auto, required or {'type': 'function', ...}", param="tool_choice")
    templ = [{"type": "function", "function": fn} for fn in functions]
    if choice == "auto":
        return ToolPlan(templ, choice, parser or detect(tokenizer))
    if choice == "required":
        calls = [
            {"type": "object", "properties": {"name": {"const": fn["name"]},
             "arguments": fn.get("parameters", {"type": "object"})}, "required": ["name", "arguments"],
             "additionalProperties": False}
            for fn in functions
        ]  # fmt: skip
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        return ToolPlan(templ, choice, "forced", Constraint.json_schema(schema, field="tool_choice"))
    params = functions[names.index(choice)].get("parameters", {"type": "object"})
    return ToolPlan(templ, choice, "named", Constraint.json_schema(params, field="tool_choice"))


def template_messages(messages: list[dict[str, Any]], raw: list[Any]) -> list[dict[str, Any]]:
    """`messages` (role and text) with each assistant message's `tool_calls` (arguments as objects)
    and each tool message's `tool_call_id`, as chat templates read them."""
    out = []
    for i, (message, source) in enumerate(zip(messages, raw, strict=True)):
        message = dict(message)
        if source.tool_calls:
            calls = []
            for call in source.tool_calls:
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise APIError(400, f"messages[{i}].tool_calls need function.name", param="messages")
                arguments = fn.get("arguments", "{}")
                if isinstance(arguments, str):
                    try:
                        arguments = json.loads(arguments or "{}")
                    except ValueError:
                        why = f"messages[{i}]: tool call arguments are not JSON"
                        raise APIError(400, why, param="messages") from None
                calls.append({"id": call.get("id"), "type": "function",
                              "function": {"name": fn["name"], "arguments": arguments}})  # fmt: skip
            message["tool_calls"] = calls
        if source.tool_call_id is not None:
            message["tool_call_id"] = source.tool_call_id
        out.append(message)
    return out


def _call(name: Any, arguments: Any, raw: str | None = None) -> dict[str, Any] | None:
    """A call; `raw`: the arguments' JSON text as the model wrote it (kept, not re-serialised)."""
    if not isinstance(name, str) or not name:
        return None
    if isinstance(arguments, str):
        text = arguments
    elif raw is not None:
        text = raw
    else:
        text = json.dumps(arguments if arguments is not None else {}, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": text}}


def _raw_members(text: str, at: int) -> dict[str, str]:
    """The JSON text of each top-level member value of the object starting at `text[at]` (`{`)."""
    decoder, out, i = json.JSONDecoder(), {}, at + 1
    for _ in range(len(text)):  # bounded: each member advances i
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        if i >= len(text) or text[i] != '"':
            break
        try:
            key, i = decoder.raw_decode(text, i)
            while i < len(text) and text[i] in " \t\r\n":
                i += 1
            if i >= len(text) or text[i] != ":":
                break
            i += 1
            while i < len(text) and text[i] in " \t\r\n":
                i += 1
            start = i
            _, i = decoder.raw_decode(text, i)
        except ValueError:
            break
        out[key] = text[start:i]
    return out


def object_call(text: str, at: int, value: dict[str, Any]) -> dict[str, Any] | None:
    """The call of the {"name", "arguments" | "parameters"} object `value`, which starts at `text[at]`."""
    raw = _raw_members(text, at)
    key = "arguments" if "arguments" in value else "parameters"
    return _call(value.get("name"), value.get(key), raw.get(key))


def json_spans(text: str) -> list[tuple[int, Any]]:
    """(start, value) of the JSON values written one after another in `text` (stops at the first that
    does not parse)."""
    decoder, out, at = json.JSONDecoder(), [], 0
    for _ in range(MAX_TOOLS):
        while at < len(text) and text[at] in " \t\r\n;,":
            at += 1
        if at >= len(text):
            break
        try:
            value, end = decoder.raw_decode(text, at)
        except ValueError:
            break
        out.append((at, value))
        at = end
    return out


def _array_calls(text: str, at: int, values: list[Any]) -> list[dict[str, Any] | None]:
    """The calls of the JSON array `values` of call objects, which starts at `text[at]` (`[`)."""
    decoder, calls, i = json.JSONDecoder(), [], at + 1
    for value in values:
        while i < len(text) and text[i] in " \t\r\n,":
            i += 1
        start = i
        _, i = decoder.raw_decode(text, i)
        if isinstance(value, dict):
            calls.append(object_call(text, start, value))
    return calls


def parse(text: str, tool_plan: ToolPlan) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a finished choice's text; no calls: the text back, unchanged."""
    calls: list[dict[str, Any] | None] = []
    content: str | None = text
    kind = tool_plan.parser
    if kind == "named":
        spans = json_spans(text)
        if spans and isinstance(spans[0][1], dict):
            start, value = spans[0]
            end = json.JSONDecoder().raw_decode(text, start)[1]
            calls, content = [_call(tool_plan.choice, value, text[start:end])], None
    elif kind == "forced":
        spans = json_spans(text)
        if spans and isinstance(spans[0][1], list):
            calls, content = _array_calls(text, *spans[0]), None
    elif kind == "hermes":
        blocks = list(re.finditer(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", text, flags=re.DOTALL))
        for block in blocks:
            for start, value in json_spans(block.group(1))[:1]:
                if isinstance(value, dict):
                    calls.append(object_call(block.group(1), start, value))
        if blocks:
            content = text.split("<tool_call>", 1)[0]
    elif kind == "mistral":
        if "[TOOL_CALLS]" in text:
            head, tail = text.split("[TOOL_CALLS]", 1)
            for start, value in json_spans(tail)[:1]:
                if isinstance(value, list):
                    calls = _array_calls(tail, start, value)
                elif isinstance(value, dict):
                    calls = [object_call(tail, start, value)]
            content = head
    else:  # llama3_json: the whole answer is the call(s)
        body = text.strip().removeprefix("<|python_tag|>")
        if body.startswith("{"):
            spans = json_spans(body)
            found = [(at, v) for at, v in spans if isinstance(v, dict) and "name" in v]
            if found and len(found) == len(spans):
                calls = [object_call(body, at, v) for at, v in found]
                content = None
    kept = [c for c in calls if c is not None]
    if not kept:
        return text, []
    content = content.rstrip() if content else None  # as streamed: trailing whitespace before a call is dropped
    return content or None, kept
