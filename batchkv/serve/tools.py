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
- A choice with calls answers `finish_reason: "tool_calls"`. Streamed, a request with tools holds
  its text until the choice ends (a call cannot be told from text before it is whole), then sends
  the text before the calls as `delta.content` and each call as `delta.tool_calls[i]` with its
  index, id, type, name and arguments.
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


def _call(name: Any, arguments: Any) -> dict[str, Any] | None:
    if not isinstance(name, str) or not name:
        return None
    text = arguments if isinstance(arguments, str) else json.dumps(arguments if arguments is not None else {})
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": text}}


def _json_values(text: str) -> list[Any]:
    """The JSON values written one after another in `text` (stops at the first that does not parse)."""
    decoder, out, at = json.JSONDecoder(), [], 0
    for _ in range(MAX_TOOLS):
        while at < len(text) and text[at] in " \t\r\n;,":
            at += 1
        if at >= len(text):
            break
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            break
        out.append(value)
    return out


def parse(text: str, tool_plan: ToolPlan) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a finished choice's text; no calls: the text back, unchanged."""
    calls: list[dict[str, Any] | None] = []
    content: str | None = text
    kind = tool_plan.parser
    if kind == "named":
        values = _json_values(text)
        if values and isinstance(values[0], dict):
            calls, content = [_call(tool_plan.choice, values[0])], None
    elif kind == "forced":
        values = _json_values(text)
        if values and isinstance(values[0], list):
            calls = [_call(c.get("name"), c.get("arguments")) for c in values[0] if isinstance(c, dict)]
            content = None
    elif kind == "hermes":
        blocks = re.findall(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", text, flags=re.DOTALL)
        for block in blocks:
            for value in _json_values(block)[:1]:
                if isinstance(value, dict):
                    calls.append(_call(value.get("name"), value.get("arguments", value.get("parameters"))))
        if blocks:
            content = text.split("<tool_call>", 1)[0]
    elif kind == "mistral":
        if "[TOOL_CALLS]" in text:
            head, tail = text.split("[TOOL_CALLS]", 1)
            for value in _json_values(tail)[:1]:
                for c in value if isinstance(value, list) else [value]:
                    if isinstance(c, dict):
                        calls.append(_call(c.get("name"), c.get("arguments", c.get("parameters"))))
            content = head
    else:  # llama3_json: the whole answer is the call(s)
        body = text.strip().removeprefix("<|python_tag|>")
        if body.startswith("{"):
            values = _json_values(body)
            found = [v for v in values if isinstance(v, dict) and "name" in v]
            if found and len(found) == len(values):
                calls = [_call(v.get("name"), v.get("parameters", v.get("arguments"))) for v in found]
                content = None
    kept = [c for c in calls if c is not None]
    if not kept:
        return text, []
    content = content.strip() if content else None
    return content or None, kept
