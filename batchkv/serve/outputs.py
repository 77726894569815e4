"""Engine events to OpenAI choices: text per sample, finish reasons, and the JSON of the answers.

`Tracker` consumes a `Stream`'s items and keeps one `Choice` per (prompt, sample), prompt-major
(choice index = prompt * n + sample). Each choice runs its tokens through the incremental
detokenizer and the stop matcher. A choice that meets a stop string finishes there ("stop") while
the engine may still be decoding it: once every sample of a prompt has finished on this side, the
tracker cancels that prompt's engine request so its columns free at once.

Finish reasons: the engine's stop -> "stop", length and capacity -> "length", cancelled -> "abort"
(vLLM's word for a request ended by the server), and the worker's "timeout" (a request past the
server's --request-timeout) -> "timeout", and a constrained sample no token could continue ->
"grammar". `Tracker.on_finish` hears each choice's reason as the client sees it (a choice the client
left before it finished: "abort"), which the server counts in /metrics.

Log-probabilities (when the job asks, `Job.logprobs`): each choice keeps its tokens' `Logprobs`
(one per id in `token_ids`, so none after a stop string), and the answers write them as OpenAI
does (`batchkv.serve.logprobs`); a streamed chunk carries those of the tokens it adds.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from batchkv.executor import Event
from batchkv.executor.request import Logprobs
from batchkv.serve import tools
from batchkv.serve.detok import IncrementalDetokenizer, StopMatcher, detokenizers
from batchkv.serve.jobs import Job
from batchkv.serve.logprobs import TokenText, chat_logprobs, completion_logprobs
from batchkv.serve.stream import Stream
from batchkv.serve.tool_stream import ToolStream

IDLE, PENDING, URGENT = 0, 1, 2  # `Tracker.feed`'s answers: what its reader needs

FINISH = {"stop": "stop", "length": "length", "capacity": "length", "cancelled": "abort", "timeout": "timeout",
          "grammar": "grammar"}  # fmt: skip


@dataclass
class Delta:
    """What one choice gained from one item: text, token ids, and its finish reason if it ended."""

    index: int
    text: str
    token_ids: list[int]
    finish: str | None
    logprobs: list[Logprobs] = field(default_factory=list)  # of token_ids, when the job asks


@dataclass(eq=False)
class Choice:
    """One sample of one prompt: its text so far (released pieces), token ids and finish reason."""

    index: int
    detok: IncrementalDetokenizer | None
    stops: StopMatcher
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    finish: str | None = None
    engine_done: bool = False
    logprobs: list[Logprobs] = field(default_factory=list)

    def add(self, event: Event, pending: dict[int, Delta]) -> bool:
        """Apply one event, merged into this choice's delta in `pending` (made if absent); False
        when it changes nothing visible (tokens after a stop string)."""
        reason, token = event.finish_reason, event.token
        if reason is not None:
            self.engine_done = True
        if self.finish is not None:
            return False
        text, stops = "", self.stops
        if token is not None:
            self.token_ids.append(token)
            if event.logprobs is not None:
                self.logprobs.append(event.logprobs)
            if self.detok is not None and reason != "stop":  # a stop id's text is not output (vLLM)
                text = self.detok.add(token)
                if stops.active:
                    text = stops.feed(text)
        if stops.stopped:
            self.finish = "stop"
        elif reason is not None:
            if self.detok is not None:
                text += stops.feed(self.detok.flush())
                text += stops.flush()
            self.finish = "stop" if stops.stopped else FINISH[reason]
        if text:
            self.text.append(text)
        delta = pending.get(self.index)
        if delta is None:
            pending[self.index] = Delta(self.index, text, [] if token is None else [token], self.finish,
                                        [] if event.logprobs is None else [event.logprobs])  # fmt: skip
            return True
        if text:
            delta.text += text
        if token is not None:
            delta.token_ids.append(token)
            if event.logprobs is not None:
                delta.logprobs.append(event.logprobs)
        delta.finish = self.finish
        return True


class Tracker:
    """The choices of one job, fed from its stream.

    Two feeders, one consumer. The engine thread (`EngineWorker`, for a tracker given to `submit`)
    feeds each step's events with `feed` (detokenising, matching stop strings) and merges the
    deltas into `pending`; the loop's
    `deltas` then takes what is pending at each wake: several steps' tokens of a choice come out as
    one delta when the reader fell behind (a client that reads slowly gets longer deltas, never a
    longer queue). A stream of raw events (a worker that does not feed trackers, such as Ray's
    frontend; the tests' scripted streams) is fed by `deltas` itself, on the loop. `lock` orders feeds, takes and the
    reader's exit, so a choice is counted in `on_finish` once."""

    def __init__(self, job: Job, tokenizer: Any | None, on_finish: Callable[[str], None] | None = None) -> None:
        self.job = job
        self.on_finish = on_finish or (lambda reason: None)  # each choice's finish reason, as the client sees it
        make = None
        if tokenizer is not None:
            options = {"skip_special_tokens": job.skip_special_tokens, "clean_up_tokenization_spaces": False}
            if not job.spaces_between_special_tokens:  # passed only when asked: the default is the tokenizer's
                options["spaces_between_special_tokens"] = False
            make = detokenizers(tokenizer, job.skip_special_tokens, lambda ids: tokenizer.decode(ids, **options))
        self.choices = [
            Choice(p * job.n + s, make(prompt) if make else None, StopMatcher(job.stops))
            for p, prompt in enumerate(job.prompts)
            for s in range(job.n)
        ]
        self.left = len(self.choices)  # choices not finished yet
        self.lock = threading.Lock()
        self.pending: dict[int, Delta] = {}  # fed, not yet taken: one merged delta per choice
        self.woken = False  # a wake for `pending` is on its way to the reader (engine thread's feeds)
        self.started = False  # the reader was woken for a first delta
        self.finished = False  # every choice had finished when `pending` was last merged
        self.closed = False  # the reader left: feeds change nothing more
        self.cancelled: set[int] = set()
        self.tokens = TokenText(tokenizer)  # logprobs' token texts
        self.offsets = [0] * len(self.choices)  # streamed completions: text_offset of each choice's next token
        self.cached: dict[int, int] = {}  # prompt index -> tokens reused from the prefix cache
        self.echoed: set[int] = set()  # streamed completions with echo: choices whose prompt text went out
        self.tool_streams: dict[int, ToolStream] = {}  # streamed chat with tools: per choice

    @property
    def done(self) -> bool:
        return self.left == 0

    def feed(self, items: list[tuple[int, Event]], cancel: Callable[[int], None]) -> int:
        """Apply one step's events; their deltas join `pending`. `cancel(prompt)` ends a prompt's
        engine request whose choices all finished here first (a stop string). Returns what the
        reader needs: `URGENT` (a streamed answer's first tokens, or every choice finished: wake it
        now), `PENDING` (streamed deltas wait: wake it when the worker's budget allows) or `IDLE`
        (nothing new, a wake already on its way, or an answer that is not streamed and not done)."""
        with self.lock:
            if self.closed:
                return IDLE
            self._apply(items, cancel)
            self.finished = self.left == 0
            if self.woken or not (self.pending or self.finished):
                return IDLE
            if self.finished or (self.job.stream and not self.started):
                self.started = True
                return URGENT
            return PENDING if self.job.stream else IDLE

    def wake(self) -> bool:
        """Claim the next wake of the reader: True when there is something to take and no wake is
        on its way (the caller then wakes it); False otherwise (or once the reader left)."""
        with self.lock:
            if self.woken or self.closed or not (self.pending or self.finished):
                return False
            self.woken = True
            return True

    def _apply(self, items: list[tuple[int, Event]], cancel: Callable[[int], None]) -> None:
        """The events' deltas merged into `pending` (under `lock`)."""
        n, choices, pending = self.job.n, self.choices, self.pending
        for prompt, event in items:
            choice = choices[prompt * n + event.sample]
            if choice.add(event, pending) and choice.finish is not None:
                self.left -= 1
                self.on_finish(choice.finish)
                self._release(cancel, prompt)

    def take(self) -> tuple[list[Delta], bool]:
        """The pending deltas (by choice) and whether every choice had finished with them (loop)."""
        with self.lock:
            out, self.pending, self.woken = self.pending, {}, False
            return sorted(out.values(), key=lambda d: d.index), self.finished

    async def deltas(self, stream: Stream) -> AsyncIterator[list[Delta]]:
        """Per wake of the stream, the deltas of the choices that changed (a choice's tokens since
        the last wake merged into one); ends when every choice finished. Leaving early (an error, a
        disconnect) cancels what the engine still decodes."""
        try:
            async for items in stream:
                self.cached.update(stream.cached)  # written by the engine thread before these events
                if items:  # raw events: fed here, on the loop
                    with self.lock:
                        self._apply(items, stream.cancel)
                        self.finished = self.done
                out, finished = self.take()
                if out:
                    yield out
                if finished:
                    return
        finally:
            with self.lock:
                self.closed = True
                engine_done = all(c.engine_done for c in self.choices)
                unfinished = [c for c in self.choices if c.finish is None]
            if not engine_done:
                stream.cancel()
            for _ in unfinished:  # the client left, or the stream failed: ended by the server
                self.on_finish(FINISH["cancelled"])

    def _release(self, cancel: Callable[[int], None], prompt: int) -> None:
        group = self.choices[prompt * self.job.n : (prompt + 1) * self.job.n]
        if prompt not in self.cancelled and all(c.finish for c in group) and not all(c.engine_done for c in group):
            self.cancelled.add(prompt)
            cancel(prompt)

    def usage(self) -> dict:
        """OpenAI `usage`: prompt tokens of every prompt (and of them those the prefix cache held:
        `prompt_tokens_details.cached_tokens`), completion tokens of every choice."""
        prompt = sum(len(p) for p in self.job.prompts)
        completion = sum(len(c.token_ids) for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached.values())}}  # fmt: skip


# ---- answers -----------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    """A response id as OpenAI writes them: `cmpl-...`, `chatcmpl-...`."""
    return f"{prefix}-{uuid.uuid4().hex}"


def completion_body(tracker: Tracker, rid: str, model: str) -> dict[str, Any]:
    """The JSON of a finished /v1/completions answer."""
    job, choices = tracker.job, []
    for c in tracker.choices:
        echo = job.echo[c.index // job.n] if job.echo is not None else ""
        choice: dict[str, Any] = {"index": c.index, "text": echo + "".join(c.text), "logprobs": None}
        if job.logprobs is not None:
            choice["logprobs"] = completion_logprobs(c.logprobs, tracker.tokens)[0]
        choice["finish_reason"] = c.finish
        if job.token_ids:
            choice["token_ids"] = c.token_ids
            choice["prompt_token_ids"] = job.prompts[c.index // job.n]
        choices.append(choice)
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": tracker.usage(),
    }


def chat_body(tracker: Tracker, rid: str, model: str) -> dict[str, Any]:
    """The JSON of a finished /v1/chat/completions answer."""
    job, choices = tracker.job, []
    for c in tracker.choices:
        message, finish = _message("".join(c.text), c.finish, job)
        choice: dict[str, Any] = {
            "index": c.index,
            "message": {"role": "assistant", **message},
            "logprobs": chat_logprobs(c.logprobs, tracker.tokens) if job.logprobs is not None else None,
            "finish_reason": finish,
        }
        if job.token_ids:
            choice["token_ids"] = c.token_ids
        choices.append(choice)
    body = {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": tracker.usage(),
    }
    if job.token_ids:
        body["prompt_token_ids"] = job.prompts[0]
    return body


def _message(text: str, finish: str | None, job: Job) -> tuple[dict[str, Any], str | None]:
    """A chat choice's message fields and finish reason: with tools, the calls parsed from its text
    (`batchkv.serve.tools`) and "tool_calls" for a choice that stopped on its own."""
    if job.tools is None:
        return {"content": text}, finish
    content, calls = tools.parse(text, job.tools)
    if not calls:
        return {"content": text}, finish
    return {"content": content, "tool_calls": calls}, ("tool_calls" if finish == "stop" else finish)


def completion_chunk(tracker: Tracker, deltas: list[Delta], rid: str, model: str, created: int) -> dict[str, Any]:
    """One streamed /v1/completions event: the choices that changed since the last chunk."""
    choices = []
    for d in deltas:
        text = d.text
        if tracker.job.echo is not None and d.index not in tracker.echoed:  # the prompt's text comes first
            tracker.echoed.add(d.index)
            text = tracker.job.echo[d.index // tracker.job.n] + text
        choice: dict[str, Any] = {"index": d.index, "text": text, "logprobs": None, "finish_reason": d.finish}
        if d.logprobs:
            offset = tracker.offsets[d.index]
            choice["logprobs"], tracker.offsets[d.index] = completion_logprobs(d.logprobs, tracker.tokens, offset)
        if tracker.job.token_ids:
            choice["token_ids"] = d.token_ids
        choices.append(choice)
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices}


def chat_chunk(tracker: Tracker, deltas: list[Delta], rid: str, model: str, created: int) -> dict[str, Any]:
    """One streamed /v1/chat/completions event (`chat.completion.chunk`)."""
    choices = []
    for d in deltas:
        delta: dict[str, Any] = {"content": d.text} if d.text or d.finish is None else {}
        finish = d.finish
        if tracker.job.tools is not None:  # text and tool-call fragments as the calls are read
            parser = tracker.tool_streams.setdefault(d.index, ToolStream(tracker.job.tools))
            content, calls = parser.feed(d.text)
            if d.finish is not None:
                more, last, finish = parser.finish(d.finish)
                content, calls = content + more, calls + last
            delta = {"content": content} if content else {}
            if calls:
                delta["tool_calls"] = calls
        lps = chat_logprobs(d.logprobs, tracker.tokens) if d.logprobs else None
        choice: dict[str, Any] = {"index": d.index, "delta": delta, "logprobs": lps, "finish_reason": finish}
        if tracker.job.token_ids:
            choice["token_ids"] = d.token_ids
        choices.append(choice)
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": choices}
