"""Streamed tool calls: one `ToolStream` per choice turns the model's text, piece by piece, into
`delta.content` and OpenAI's `delta.tool_calls` fragments (the format rules are in
`batchkv.serve.tools`' docstring; the whole-text parser there is what a stream must agree with)."""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from batchkv.serve.tools import MAX_TOOLS, ToolPlan, json_spans, object_call, parse

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
        for start, value in json_spans(block)[:1]:
            call = object_call(block, start, value) if isinstance(value, dict) else None
            if call is not None:
                self.calls += 1
                out.append({"index": self.calls - 1, **call})
        return out
