"""Constrained decoding: a sample's output kept inside a language (JSON schema, regex, choices, EBNF
grammar), with xgrammar as the grammar engine.

- `Constraint` is what a request carries (`SamplingParams.constraint`); `Grammars` binds a
  tokenizer (`Engine.use_tokenizer`): it compiles constraints, cached by constraint (a `Grammars`
  serves one tokenizer), within `COMPILE_SECONDS`, and gives each constrained sample its own
  matcher when it first samples.
- A step with constrained rows: the runner queues the forward, then the host fills each
  constrained row's allowed-token bitmask (int32 [rows, ceil(V / 32)], one bit per token) into a
  pinned slot while the device runs it, and copies it into a fixed-address device buffer; the
  sampler drops the disallowed tokens (`allowed`) before sampling. Unconstrained rows of that step
  get an all-ones row. A step with no constrained row fills nothing and launches nothing more.
- Under overlap a constrained row's newest token may still be on the device when its step is
  planned: the host reads the previous step's tokens (the step the device has finished or is
  finishing, the forward of this one already queued behind it), and the matcher looks one token
  ahead (accept, fill, roll back).
- Matchers advance only on accepted tokens, as the scheduler records them (`accept`); verify steps
  (speculation) fill one row per draft by looking ahead through the drafts and rolling back, so a
  rewind never reaches a matcher. A token the matcher refuses (no token could continue: the mask
  was empty) ends the sample with finish reason "grammar"; a matcher that terminates (the grammar
  is complete and a stop id was sampled, or it needs no stop id) ends it with "stop".
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from batchkv.errors import DependencyError, RequestError

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_CONSTRAINT_CHARS = 65_536  # a schema, regex or grammar longer than this is refused
MAX_CHOICES = 1024
COMPILE_SECONDS = 10.0  # a constraint that takes longer to compile is refused
CACHE_ENTRIES = 256  # compiled grammars kept per tokenizer (least recently used dropped)
INSTALL = "pip install 'batchkv[structured]' (xgrammar)"


def _xgrammar():
    try:
        import xgrammar
    except ImportError as exc:  # pragma: no cover - the extra is part of `test`
        raise DependencyError(f"constrained decoding needs xgrammar: {INSTALL}") from exc
    return xgrammar


@dataclass(frozen=True)
class Constraint:
    """What a constrained sample's output must be. Build it with a constructor:

    Constraint.json_schema({"type": "object", ...})   JSON valid under the schema
    Constraint.json_schema(None)                      any JSON object (OpenAI's json_object)
    Constraint.regex(r"[0-9]{3}-[0-9]{4}")            a string the regex matches whole
    Constraint.choice(["yes", "no"])                  exactly one of the strings
    Constraint.grammar('root ::= "a" root | "b"')     a string of the EBNF grammar (xgrammar's GBNF)

    `field` names where it came from in an API request (the server's 400s name it)."""

    kind: str
    spec: str
    field: str = "constraint"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise RequestError(f"{self.field}: constraint kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if not isinstance(self.spec, str):
            raise RequestError(f"{self.field}: the constraint is a {type(self.spec).__name__}; expected text")
        if len(self.spec) > MAX_CONSTRAINT_CHARS:
            raise RequestError(
                f"{self.field}: the {self.kind} is {len(self.spec)} characters; at most {MAX_CONSTRAINT_CHARS}"
            )

    @classmethod
    def json_schema(cls, schema: dict | str | bool | None, field: str = "constraint") -> Constraint:
        """JSON valid under `schema` (a dict, or its JSON text); None: any JSON object."""
        if schema is None:
            return cls("json_object", "", field)
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise RequestError(f"{field}: the JSON schema is not valid JSON ({exc})") from None
        if not isinstance(schema, (dict, bool)):
            raise RequestError(f"{field}: a JSON schema is an object, not a {type(schema).__name__}")
        try:
            text = json.dumps(schema, sort_keys=True, separators=(",", ":"))
        except (TypeError, ValueError) as exc:
            raise RequestError(f"{field}: the JSON schema cannot be written as JSON ({exc})") from None
        return cls("json_schema", text, field)

    @classmethod
    def regex(cls, pattern: str, field: str = "constraint") -> Constraint:
        """Text the regular expression matches in full."""
        if not isinstance(pattern, str) or not pattern:
            raise RequestError(f"{field}: a regex constraint is a non-empty string, not {pattern!r}")
        return cls("regex", pattern, field)

    @classmethod
    def choice(cls, options: Sequence[str], field: str = "constraint") -> Constraint:
        """Exactly one of `options` (non-empty strings)."""
        if isinstance(options, str) or not isinstance(options, Sequence) or not options:
            raise RequestError(f"{field}: choices are a non-empty list of strings, not {options!r}")
        if len(options) > MAX_CHOICES:
            raise RequestError(f"{field}: {len(options)} choices; at most {MAX_CHOICES}")
        if not all(isinstance(o, str) and o for o in options):
            raise RequestError(f"{field}: every choice must be a non-empty string")
        return cls("choice", json.dumps(list(options), ensure_ascii=False), field)

    @classmethod
    def grammar(cls, ebnf: str, field: str = "constraint") -> Constraint:
        """A string of the EBNF grammar (xgrammar's GBNF dialect; the start rule is `root`)."""
        if not isinstance(ebnf, str) or not ebnf.strip():
            raise RequestError(f"{field}: a grammar constraint is non-empty EBNF text, not {ebnf!r}")
        return cls("grammar", ebnf, field)

    def ebnf(self) -> str | None:
        """The grammar a choice constraint compiles to (None for the other kinds)."""
        if self.kind != "choice":
            return None
        return "root ::= " + " | ".join(json.dumps(o, ensure_ascii=False) for o in json.loads(self.spec))


class Grammars:
    """xgrammar over one tokenizer: compiled grammars (cached), matchers, bitmask rows.

    tokenizer: a transformers tokenizer (`xgrammar.TokenizerInfo.from_huggingface`) or an
    `xgrammar.TokenizerInfo`; vocab_size: the model's logits width (may exceed the tokenizer's)."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        xgr = _xgrammar()
        if isinstance(tokenizer, xgr.TokenizerInfo):
            info = tokenizer
        else:
            try:
                info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
            except Exception as exc:  # xgrammar raises plain errors for tokenizers it cannot read
                raise RequestError(f"xgrammar cannot read this tokenizer ({exc}); constraints are unavailable") from exc
        self.info, self.vocab_size = info, vocab_size
        self.words = math.ceil(vocab_size / 32)
        self.compiler = xgr.GrammarCompiler(info, max_threads=2)
        self._cache: OrderedDict[Constraint, Any] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar")

    def compile(self, constraint: Constraint, timeout: float = COMPILE_SECONDS) -> Any:
        """The compiled grammar of `constraint` (cached); RequestError naming its field when it is
        malformed, unsupported, or takes more than `timeout` seconds to compile. Safe from any
        thread; the server calls it off the event loop before submitting."""
        key = Constraint(constraint.kind, constraint.spec)  # the cache ignores where it came from
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        future = self._pool.submit(self._compile, constraint)
        try:
            compiled = future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            raise RequestError(
                f"{constraint.field}: compiling the {constraint.kind} took more than {timeout:g} s; simplify it"
            ) from None
        except RequestError:
            raise
        except Exception as exc:  # xgrammar's parse errors are plain RuntimeError/ValueError
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise RequestError(f"{constraint.field}: the {constraint.kind} is not supported: {message}") from None
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, c: Constraint) -> Any:
        comp = self.compiler
        if c.kind in ("json_object", "json_schema"):
            # Compact JSON (no free whitespace): a small model can otherwise loop on spaces forever.
            spec = c.spec if c.kind == "json_schema" else '{"type": "object"}'
            return comp.compile_json_schema(spec, any_whitespace=False, strict_mode=True)
        if c.kind == "regex":
            return comp.compile_regex(c.spec)
        return comp.compile_grammar(c.ebnf() or c.spec)

    def matcher(self, compiled: Any, stop_ids: Sequence[int]) -> Any:
        """A fresh matcher of `compiled` ending at `stop_ids` (none: it ends when the grammar is)."""
        xgr = _xgrammar()
        return xgr.GrammarMatcher(
            compiled,
            override_stop_tokens=list(stop_ids) or None,
            terminate_without_stop_token=not stop_ids,
        )

    def fill(self, matcher: Any, out: torch.Tensor, index: int, ahead: Sequence[int] = ()) -> bool:
        """Write into row `index` of `out` (int32 [rows, words], CPU) the tokens `matcher` allows
        after `ahead` (tokens not yet accepted: looked at, then rolled back). False when `ahead`
        leaves the grammar or ends it (the row is then all ones: that row's token is discarded)."""
        taken = 0
        ok = True
        for token in ahead:
            if matcher.is_terminated() or not matcher.accept_token(int(token)):
                ok = False
                break
            taken += 1
        if ok and not matcher.is_terminated():
            matcher.fill_next_token_bitmask(out, index)
        else:
            out[index] = -1
            ok = False
        if taken:
            matcher.rollback(taken)
        return ok


def accept(matcher: Any, token: int) -> str | None:
    """Advance a sample's matcher on a token the host recorded: None to go on, "stop" when the
    grammar has ended, "grammar" when the token is not allowed (no token could continue it)."""
    if not matcher.accept_token(int(token)):
        return "grammar"
    return "stop" if matcher.is_terminated() else None


def allowed(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool [rows, vocab] from int32 [rows, ceil(vocab / 32)] bitmask rows (bit t % 32 of word
    t // 32 set: token t allowed). Static shapes, no host reads (graph-safe)."""
    ids = torch.arange(vocab, device=bitmask.device)
    words = bitmask.index_select(1, ids >> 5)
    return ((words >> (ids & 31).to(torch.int32)) & 1).bool()


class MaskRows:
    """A runner's bitmask buffers, allocated at the first constrained step and kept: two pinned host
    slots (alternating with the launches' token slots, so a slot is rewritten only after the step
    that read it was finished) and one fixed-address device buffer of `rows` rows."""

    def __init__(self, rows: int, words: int, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.pin = pin
        self.host = torch.full((2, rows, words), -1, dtype=torch.int32, pin_memory=pin)
        self.device = torch.full((rows, words), -1, dtype=torch.int32, device=device)

    def upload(self, slot: int, count: int) -> None:
        """Copy the first `count` rows of host slot `slot` to the device buffer (queued, no wait)."""
        self.device[:count].copy_(self.host[slot, :count], non_blocking=self.pin)


def fill_step(
    grammars: Grammars,
    samples: Sequence[Any],
    host: torch.Tensor,
    ahead: Callable[[int], Sequence[int]],
) -> None:
    """Fill `host` (int32 [>= len(samples), words]) for one step's sampling rows: a constrained
    sample's row from its matcher after `ahead(i)` (its tokens not yet recorded), every other row
    all ones. Creates a sample's matcher the first time it samples."""
    for i, sample in enumerate(samples):
        compiled = sample.owner.grammar
        if compiled is None:
            host[i] = -1
            continue
        if sample.matcher is None:
            sample.matcher = grammars.matcher(compiled, sample.owner.request.params.stop_token_ids)
        grammars.fill(sample.matcher, host, i, ahead(i))


def constrained(samples: Sequence[Any]) -> bool:
    """True when some sample of the step is constrained."""
    return any(sample.owner.grammar is not None for sample in samples)


__all__ = ["COMPILE_SECONDS", "Constraint", "Grammars", "MaskRows", "accept", "allowed", "fill_step"]
