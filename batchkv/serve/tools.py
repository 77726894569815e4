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
- Streamed (`ToolStream`, one per choice), calls go out as OpenAI streams them, incrementally over
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


def _object_call(text: str, at: int, value: dict[str, Any]) -> dict[str, Any] | None:
    """The call of the {"name", "arguments" | "parameters"} object `value`, which starts at `text[at]`."""
    raw = _raw_members(text, at)
    key = "arguments" if "arguments" in value else "parameters"
    return _call(value.get("name"), value.get(key), raw.get(key))


def _json_spans(text: str) -> list[tuple[int, Any]]:
    """(start, value) of the JSON values written one after another in `text` (as `_json_values`)."""
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
            calls.append(_object_call(text, start, value))
    return calls


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
        spans = _json_spans(text)
        if spans and isinstance(spans[0][1], dict):
            start, value = spans[0]
            end = json.JSONDecoder().raw_decode(text, start)[1]
            calls, content = [_call(tool_plan.choice, value, text[start:end])], None
    elif kind == "forced":
        spans = _json_spans(text)
        if spans and isinstance(spans[0][1], list):
            calls, content = _array_calls(text, *spans[0]), None
    elif kind == "hermes":
        blocks = list(re.finditer(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", text, flags=re.DOTALL))
        for block in blocks:
            for start, value in _json_spans(block.group(1))[:1]:
                if isinstance(value, dict):
                    calls.append(_object_call(block.group(1), start, value))
        if blocks:
            content = text.split("<tool_call>", 1)[0]
    elif kind == "mistral":
        if "[TOOL_CALLS]" in text:
            head, tail = text.split("[TOOL_CALLS]", 1)
            for start, value in _json_spans(tail)[:1]:
                if isinstance(value, list):
                    calls = _array_calls(tail, start, value)
                elif isinstance(value, dict):
                    calls = [_object_call(tail, start, value)]
            content = head
    else:  # llama3_json: the whole answer is the call(s)
        body = text.strip().removeprefix("<|python_tag|>")
        if body.startswith("{"):
            spans = _json_spans(body)
            found = [(at, v) for at, v in spans if isinstance(v, dict) and "name" in v]
            if found and len(found) == len(spans):
                calls = [_object_call(body, at, v) for at, v in found]
                content = None
    kept = [c for c in calls if c is not None]
    if not kept:
        return text, []
    content = content.rstrip() if content else None  # as streamed: trailing whitespace before a call is dropped
    return content or None, kept


MARKERS = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]"}
HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(arguments|parameters)"\s*:\s*')
_SPACE = " \t\r\n"


class _Extent:
    """Where a JSON value ends, fed its text piece by piece (strings, escapes and nesting tracked).
    `depth` > 0 starts it inside that many open containers (then it ends when they close)."""

    def __init__(self, start: int, depth: int = 0) -> None:
        self.at = self.first = start  # the next character to read; the value's first
        self.depth, self.inside, self.escaped, self.started = depth, False, False, depth > 0
        self.scalar = False  # a bare number / true / false / null

    def end(self, text: str) -> int | None:
        """Index just past the value's end in `text` (read on from where the last call stopped),
        or None when it goes on."""
        for i in range(self.at, len(text)):
            self.at = i + 1
            ch = text[i]
            if self.inside:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.inside = False
                    if self.depth == 0:
                        return i + 1
                continue
            if self.scalar:
                if ch in _SPACE or ch in ",}]":
                    self.at = i
                    return i
                continue
            if ch == '"':
                self.inside, self.started = True, True
            elif ch in "{[":
                self.depth, self.started = self.depth + 1, True
            elif ch in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    return i + 1
            elif ch not in _SPACE and not self.started:
                self.scalar = self.started = True
        return None


class ToolStream:
    """One streamed choice of a request with tools: `feed` each text delta, `finish` at its end.
    Each returns (content, tool-call deltas) to send: content text (possibly empty) and the
    `delta.tool_calls` entries, indexed per choice (see the module docstring)."""

    def __init__(self, tool_plan: ToolPlan) -> None:
        self.plan = tool_plan
        self.text = ""
        self.pos = 0  # how far the text has been turned into deltas
        self.held = ""  # content held back: trailing whitespace (a call may follow)
        self.calls = 0  # calls opened so far
        kind = tool_plan.parser
        self.state = {"named": "named", "forced": "array_open", "llama3_json": "hold"}.get(kind, "text")
        self.extent: _Extent | None = None
        self.block = 0  # hermes / mistral: where the current call's object (or array) began

    def feed(self, piece: str) -> tuple[str, list[dict[str, Any]]]:
        """The deltas `piece` (the choice's next text) makes ready."""
        self.text += piece
        content: list[str] = []
        calls: list[dict[str, Any]] = []
        for _ in range(4 * MAX_TOOLS + 8):  # each pass moves to another state or waits for text
            before = (self.state, self.pos)
            getattr(self, f"_{self.state}")(content, calls)
            if (self.state, self.pos) == before:
                break
        return "".join(content), calls

    def finish(self, reason: str | None) -> tuple[str, list[dict[str, Any]], str | None]:
        """The last deltas and the finish reason the client sees ("tool_calls" for a choice that
        stopped on its own after a call)."""
        content, calls = self.feed("")
        if self.state == "hold":  # llama3_json: the whole answer decides
            text, parsed = parse(self.text, self.plan)
            content += text or ""
            calls += [{"index": i, **call} for i, call in enumerate(parsed)]
            self.calls = len(parsed)
        elif self.state == "text" and not self.calls:
            content += self.held + self.text[self.pos :]
        elif self.state == "head":  # a call whose name did not come first: out whole if it parses
            calls += self._whole(self.text[self.block :])
        if self.calls and reason == "stop":
            reason = "tool_calls"
        return content, calls, reason

    # ---- states: each moves on as far as the text allows -----------------------------------
    def _text(self, content: list[str], calls: list[dict[str, Any]]) -> None:
        marker = MARKERS[self.plan.parser]
        found = self.text.find(marker, self.pos)
        if found >= 0:
            before = (self.held + self.text[self.pos : found]).rstrip()
            if before and not self.calls:
                content.append(before)
            self.held = ""
            self.pos = found + len(marker)
            self.block = self.pos
            self.state = "head" if self.plan.parser == "hermes" else "mistral_open"
            return
        end = len(self.text)
        for k in range(min(len(marker) - 1, end - self.pos), 0, -1):  # a marker's start may be arriving
            if marker.startswith(self.text[end - k :]):
                end -= k
                break
        piece = self.text[self.pos : end]
        kept = piece.rstrip()
        if kept:
            if not self.calls:  # after a call, text between calls is not content (as parse reads it)
                content.append(self.held + kept)
            self.held = piece[len(kept) :]
        else:
            self.held += piece
        self.pos = end

    def _head(self, content: list[str], calls: list[dict[str, Any]]) -> None:
        match = HEAD.match(self.text, self.pos)
        if match is None:  # not yet, or the name does not come first: the call goes out whole
            if self.plan.parser == "hermes":
                end = self.text.find("</tool_call>", self.pos)
                if end >= 0:
                    calls += self._whole(self.text[self.block : end])
                    self.pos, self.state = end + len("</tool_call>"), "text"
                return
            end = _Extent(self.block).end(self.text)
            if end is not None:
                calls += self._whole(self.text[self.block : end])
                self.pos, self.state = end, ("array_next" if self.in_array else "done")
            return
        calls.append(self._open(json.loads(match.group(1))))
        self.pos, self.state, self.extent = match.end(), "arguments", None

    def _arguments(self, content: list[str], calls: list[dict[str, Any]]) -> None:
        if self.extent is None:  # the value's text starts at its first character
            self.pos = self._skip(self.pos)
            if self.pos >= len(self.text):
                return
            self.extent = _Extent(self.pos)
        end = self.extent.end(self.text)
        stop = len(self.text) if end is None else end
        quoted = self.text[self.extent.first] == '"'  # arguments written as a JSON string: its text is the arguments
        if (self.extent.scalar or quoted) and end is None:
            return  # a bare value's end is only known at a delimiter; a string's text once it closes
        if stop > self.pos:
            piece = self.text[self.pos : stop]
            calls.append({"index": self.calls - 1, "function": {"arguments": json.loads(piece) if quoted else piece}})
        self.pos = stop
        if end is not None:
            self.state = {"hermes": "hermes_tail", "named": "done"}.get(self.plan.parser, "object_tail")
            self.extent = _Extent(stop, depth=1)

    def _hermes_tail(self, content: list[str], calls: list[dict[str, Any]]) -> None:
        end = self.text.find("</tool_call>", self.pos)
        if end >= 0:
            self.pos, self.state, self.block = end + len("</tool_call>"), "text", len(self.text)

    def _object_tail(self, content: list[str], calls: list[dict[str, Any]]) -> None:
        assert self.extent is not None
        end = self.extent.end(self.text)
        self.pos = len(self.text) if end is None else end
        if end is not None:
            self.state = "array_next" if self.in_array else "done"

    in_array = False

    def _mistral_open(self, content: list[str], calls: list[dict[str, Any]]) -> None:
        at = self._skip(self.pos)
        if at < len(self.text):
            if self.text[at] == "[":
                self.pos, self.state, self.in_array = at + 1, "array_next", True
            else:
                self.pos, self.state, self.block = at, "head", at

    def _array_open(self, content: list[str], calls: list[dict[str, Any]]) -> None:
        at = self._skip(self.pos)
        if at < len(self.text):
            self.pos, self.state, self.in_array = at + 1, ("array_next" if self.text[at] == "[" else "done"), True

    def _array_next(self, content: list[str], calls: list[dict[str, Any]]) -> None:
        at = self._skip(self.pos, " \t\r\n,")
        if at < len(self.text):
            self.pos, self.block = at, at
            self.state = "head" if self.text[at] == "{" else "done"

    def _named(self, content: list[str], calls: list[dict[str, Any]]) -> None:
        at = self._skip(self.pos)
        if at < len(self.text):
            calls.append(self._open(self.plan.choice))
            self.pos, self.state, self.extent = at, "arguments", None

    def _hold(self, content: list[str], calls: list[dict[str, Any]]) -> None:
        return None

    def _done(self, content: list[str], calls: list[dict[str, Any]]) -> None:
        self.pos = len(self.text)

    # ---- helpers -----------------------------------------------------------------------------
    def _skip(self, at: int, chars: str = _SPACE) -> int:
        while at < len(self.text) and self.text[at] in chars:
            at += 1
        return at

    def _open(self, name: str) -> dict[str, Any]:
        """A call's first delta: index, id, type, name and empty arguments."""
        self.calls += 1
        call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": ""}}
        return {"index": self.calls - 1, **call}

    def _whole(self, block: str) -> list[dict[str, Any]]:
        """A call whose name did not come first, sent whole once its object is (none if it does not parse)."""
        out = []
        for start, value in _json_spans(block)[:1]:
            call = _object_call(block, start, value) if isinstance(value, dict) else None
            if call is not None:
                self.calls += 1
                out.append({"index": self.calls - 1, **call})
        return out
