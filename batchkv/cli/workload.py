"""Workloads for the engine: a seeded synthetic generator, a JSONL reader, and the replay loop.

A workload is a list of `WorkItem(arrival_step, request)`: the request is submitted before the
engine's step number `arrival_step` (steps the engine actually ran; an idle engine jumps to the next
arrival instead of spinning).

JSONL: one request object per line; `JSONL_HELP` (also printed by `batchkv run --help`) lists the
fields, their defaults and an example. A line gives its prompt as "prompt_ids" or, for a model with
a tokenizer, as text in "prompt"; unknown fields are refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from os import PathLike
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from batchkv.checks import int_arg, int_args, real_arg
from batchkv.errors import BatchKVError, WorkloadError
from batchkv.executor.engine import Engine
from batchkv.executor.request import Event, Output, Request, SamplingParams, gather


@dataclass(frozen=True)
class WorkItem:
    """A request and the engine step before which it arrives."""

    arrival_step: int
    request: Request


def synthetic(
    num_requests: int,
    *,
    vocab_size: int,
    prompt_len: tuple[int, int] = (16, 96),
    output_len: tuple[int, int] = (16, 64),
    arrival_gap: float = 1.0,
    seed: int = 0,
    sampling: SamplingParams | None = None,
    prompts: Sequence[Sequence[int]] | None = None,
) -> list[WorkItem]:
    """`num_requests` requests with prompt and output lengths uniform in the given inclusive ranges,
    prompt tokens uniform over the vocabulary, and arrivals spaced by geometric gaps with mean
    `arrival_gap` steps (0: all at step 0). `sampling` gives every other parameter; each request
    gets seed `seed + i` when `sampling.seed` is None, so the run is reproducible. `prompts` (token
    ids of real text) replaces the random prompts: request i asks `prompts[i % len(prompts)]`.
    """
    for name, bounds in (("prompt_len", prompt_len), ("output_len", output_len)):
        values = int_args(name, bounds, 1, error=WorkloadError)
        if len(values) != 2 or values[0] > values[1]:
            raise WorkloadError(f"{name} range {bounds} must be (min, max) with 1 <= min <= max")
    num_requests = int_arg("num_requests", num_requests, 0, error=WorkloadError)
    vocab_size = int_arg("vocab_size", vocab_size, 1, error=WorkloadError)
    seed = int_arg("seed", seed, 0, error=WorkloadError)
    if real_arg("arrival_gap", arrival_gap, error=WorkloadError) < 0:
        raise WorkloadError(f"arrival_gap is {arrival_gap}; it must be >= 0 (0: all at once)")
    base = sampling or SamplingParams()
    rng = np.random.default_rng(seed)
    items, step = [], 0
    for i in range(num_requests):
        if prompts:
            prompt = list(prompts[i % len(prompts)])
        else:
            prompt = rng.integers(0, vocab_size, size=int(rng.integers(prompt_len[0], prompt_len[1] + 1))).tolist()
        params = dataclasses.replace(
            base,
            max_new_tokens=int(rng.integers(output_len[0], output_len[1] + 1)),
            seed=base.seed if base.seed is not None else seed + i,
        )
        if i and arrival_gap > 0:
            step += int(rng.geometric(1.0 / (1.0 + arrival_gap))) - 1
        items.append(WorkItem(step, Request(prompt, params)))
    return items


JSONL_HELP = """\
workload file (--workload PATH): JSON Lines, one request per line (blank lines are skipped)
  field           type        default   meaning
  prompt_ids      [int]       -         prompt token ids, each in [0, vocab) (this or prompt)
  prompt          str         -         prompt text, tokenized by the model's tokenizer as given (no chat
                                        template); a model without a tokenizer (a preset) needs prompt_ids
  max_new_tokens  int         16        most tokens generated per sample
  temperature     float       0.0       0 is greedy; > 0 samples from softmax(logits / temperature)
  top_k           int         0         keep the k most likely tokens (0: off)
  top_p           float       1.0       keep the smallest set of tokens holding this mass (1.0: off)
  seed            int | null  null      sampling seed (null: drawn from --seed)
  stop_token_ids  [int]       []        generating one of these ends the sample (it is emitted)
  n               int         1         parallel samples of the request
  rope_offset     int         0         RoPE index t of the first prompt token
  priority        int         0         lower runs first (Request.priority: strict, background work)
  presence_penalty    float  0.0    subtracted once from the logit of every token already generated
  frequency_penalty   float  0.0    subtracted from a token's logit per time it was generated
  repetition_penalty  float  1.0    divides positive logits (multiplies negative) of prompt and output tokens
  min_p               float  0.0    drop tokens less likely than min_p times the most likely one
  min_tokens          int    0      no stop id or EOS before this many tokens
  logit_bias          {str: float}  {}  added to the named token ids' logits ({"token id": bias})
  constraint      {kind: spec} null     the output kept inside a language (xgrammar; needs the model's
                                        tokenizer), one key: {"json_schema": {...}} (a schema object or its
                                        text; null: any JSON object), {"json_object": true}, {"regex": "..."},
                                        {"choice": ["a", "b"]} or {"grammar": "root ::= ..."} (EBNF)
  arrival_step    int         0         engine step before which the request is submitted
unknown fields are refused; example lines (the second constrained to one of two answers):
  {"prompt": "Is the sky green? Answer:", "max_new_tokens": 4, "constraint": {"choice": [" yes", " no"]}}
  {"prompt_ids": [151644, 872, 198], "max_new_tokens": 32, "temperature": 0.7, "seed": 1}"""


class _Line(msgspec.Struct, forbid_unknown_fields=True):
    prompt_ids: list[int] | None = None
    prompt: str | None = None
    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: list[int] = []
    n: int = 1
    rope_offset: int = 0
    priority: int = 0
    arrival_step: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: dict[int, float] = {}
    constraint: Any = None  # {kind: spec}; checked by constraint_of


CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


def constraint_of(spec: object) -> object:
    """A JSONL line's "constraint" ({kind: spec}, one key) as a `Constraint`, the spellings of the
    `Constraint` constructors; WorkloadError naming what is wrong."""
    from batchkv.executor.constraints import Constraint  # no xgrammar needed to build one

    if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in CONSTRAINT_KINDS:
        raise WorkloadError(
            f"constraint is {spec!r}; give one key of {', '.join(CONSTRAINT_KINDS)}, "
            'e.g. {"regex": "[0-9]+"} or {"json_schema": {"type": "object"}}'
        )
    ((kind, value),) = spec.items()
    if kind == "json_object":
        if value not in (True, None, {}):
            raise WorkloadError(f'constraint json_object is {value!r}; write {{"json_object": true}}')
        return Constraint.json_schema(None)
    if kind == "json_schema":
        return Constraint.json_schema(value)
    return getattr(Constraint, kind)(value)


def load_jsonl(path: str | Path, encode: Callable[[str], list[int]] | None = None) -> list[WorkItem]:
    """Read a JSONL workload; a bad line raises WorkloadError naming the line, field and rule.
    `encode` turns a line's text "prompt" into token ids (None: the model has no tokenizer)."""
    if not isinstance(path, (str, PathLike)):  # an int would open that file descriptor
        raise WorkloadError(f"load_jsonl reads a file path, not {type(path).__name__}")
    decoder = msgspec.json.Decoder(_Line)
    items = []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                line = decoder.decode(raw)
                prompt = _prompt(line, encode)
                params = SamplingParams(
                    max_new_tokens=line.max_new_tokens,
                    temperature=line.temperature,
                    top_k=line.top_k,
                    top_p=line.top_p,
                    seed=line.seed,
                    stop_token_ids=tuple(line.stop_token_ids),
                    n=line.n,
                    presence_penalty=line.presence_penalty,
                    frequency_penalty=line.frequency_penalty,
                    repetition_penalty=line.repetition_penalty,
                    min_p=line.min_p,
                    min_tokens=line.min_tokens,
                    logit_bias=line.logit_bias,
                    constraint=None if line.constraint is None else constraint_of(line.constraint),
                )
                request = Request(prompt, params, rope_offset=line.rope_offset, priority=line.priority)
            except (msgspec.ValidationError, msgspec.DecodeError, BatchKVError) as exc:
                raise WorkloadError(f"{path}:{number}: {exc}") from exc
            if line.arrival_step < 0:
                raise WorkloadError(f"{path}:{number}: arrival_step is {line.arrival_step}; it must be >= 0")
            items.append(WorkItem(line.arrival_step, request))
    return items


def _prompt(line: _Line, encode: Callable[[str], list[int]] | None) -> list[int]:
    """A line's prompt token ids: its prompt_ids, or its text prompt encoded."""
    if (line.prompt_ids is None) == (line.prompt is None):
        raise WorkloadError('give the prompt as "prompt_ids" (token ids) or as "prompt" (text), one of them')
    if line.prompt_ids is not None:
        return line.prompt_ids
    if encode is None:
        raise WorkloadError('"prompt" is text, and the model has no tokenizer (a preset): give "prompt_ids"')
    return encode(line.prompt)


@dataclass
class ReplayResult:
    """What a replay produced: every event, the id of each submitted item, and the refusals."""

    events: list[Event]
    request_ids: list[int | None]  # per work item; None when refused (or not yet submitted)
    refusals: list[tuple[int, str]]  # (item index, message)
    interrupted: bool = False  # stopped by Ctrl-C before every request finished

    def outputs(self, items: list[WorkItem]) -> list[tuple[int, Output | None]]:
        """(item index, its gathered Output, or None when it was never submitted), in workload order."""
        n = {rid: item.request.params.n for rid, item in zip(self.request_ids, items, strict=True) if rid is not None}
        gathered = gather(self.events, n)
        empty = {rid: Output([[] for _ in range(k)], [None] * k) for rid, k in n.items()}
        return [(i, None if rid is None else gathered.get(rid, empty[rid])) for i, rid in enumerate(self.request_ids)]


def replay(
    engine: Engine,
    items: Iterable[WorkItem],
    on_step: Callable[[list[Event]], None] | None = None,
    *,
    stop_on_interrupt: bool = False,
) -> ReplayResult:
    """Submit each item at its arrival step and step the engine until everything has finished.

    A request the engine refuses is recorded and skipped; the others keep running. With
    `stop_on_interrupt`, Ctrl-C (KeyboardInterrupt) ends the replay early: the result holds what
    came out until then and `interrupted` is True.
    """
    order = sorted(enumerate(items), key=lambda pair: pair[1].arrival_step)
    result = ReplayResult([], [None] * len(order), [])
    try:
        _replay(engine, order, on_step, result)
    except KeyboardInterrupt:
        if not stop_on_interrupt:
            raise
        result.interrupted = True
    return result


def _replay(
    engine: Engine,
    order: list[tuple[int, WorkItem]],
    on_step: Callable[[list[Event]], None] | None,
    result: ReplayResult,
) -> None:
    step, cursor = 0, 0
    while cursor < len(order) or engine.has_work:
        while cursor < len(order) and order[cursor][1].arrival_step <= step:
            index, item = order[cursor]
            cursor += 1
            try:
                result.request_ids[index] = engine.submit(item.request)
            except BatchKVError as exc:
                result.refusals.append((index, str(exc)))
        if not engine.has_work:
            if cursor < len(order):
                step = order[cursor][1].arrival_step  # idle: jump to the next arrival
            continue
        events = engine.step()
        step += 1
        result.events += events
        if on_step is not None:
            on_step(events)
