"""What goes into the engine (`Request`, `SamplingParams`) and what comes out (`Event`).

Both input types are frozen and validated on construction, so a request that breaks a rule never
reaches the engine. Rules that depend on the engine (capacity, max_seqs, vocabulary) are checked by
`Engine.submit`, through `fit_problem` for the ones its store and step decide.
"""

from __future__ import annotations

from collections import namedtuple
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields, replace
from itertools import repeat
from typing import TYPE_CHECKING, Protocol

from batchkv.cache.config import MAX_POSITIONS
from batchkv.checks import int_arg, int_args, real_arg
from batchkv.errors import RequestError

if TYPE_CHECKING:
    import torch

    from batchkv.cache import BatchedSequenceCache

FINISH_REASONS = ("stop", "length", "capacity", "cancelled", "grammar")
# Most sampling rows of one step (sequences that decode together; a request's n samples all sample
# in the step its prompt ends, so n is bounded by it too). Past 256 rows the runner makes the float32
# logits [256, vocab] at a time (`batchkv.executor.rows.HEAD_CHUNK`).
MAX_SAMPLE_ROWS = 1024
MAX_SEED = 2**64 - 1  # seeds feed splitmix64
MAX_TOP_K = 2**31 - 1  # staged as int64 each step; any k at or past the vocabulary keeps every token
MAX_PRIORITY = 2**31 - 1  # priorities are int32's range
MAX_LOGPROBS = 20  # most alternatives per token (OpenAI's top_logprobs bound, vLLM's default max_logprobs)
MAX_LOGIT_BIAS = 1024  # most logit_bias entries of one request (each staged every step it samples)
MAX_BIAS = 100.0  # OpenAI's range of one logit_bias value: [-100, 100]
MAX_PENALTY = 2.0  # OpenAI's range of presence_penalty and frequency_penalty: [-2, 2]
MAX_REPETITION_PENALTY = 100.0  # repetition_penalty lies in (0, 100]; 1 is off


def _int_tuple(values: Iterable[int], what: str) -> tuple[int, ...]:
    """Token ids as Python ints; a float (1.5, even 2.0), bool or str id is refused, not truncated."""
    return int_args(what, values, 0, error=RequestError)


def _logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    """logit_bias as sorted (token id, bias) pairs, from a mapping or pairs; refused out of range."""
    if isinstance(value, dict):
        value = tuple(value.items())
    if not isinstance(value, (tuple, list)):
        raise RequestError(f"logit_bias is a {type(value).__name__}; give {{token id: bias}} or (id, bias) pairs")
    if len(value) > MAX_LOGIT_BIAS:
        raise RequestError(f"logit_bias has {len(value)} entries; at most {MAX_LOGIT_BIAS} are allowed")
    out: dict[int, float] = {}
    for entry in value:
        if not isinstance(entry, (tuple, list)) or len(entry) != 2:
            raise RequestError(f"logit_bias entry {entry!r} is not a (token id, bias) pair")
        token = int_arg("logit_bias token id", entry[0], 0, error=RequestError)
        bias = real_arg(f"logit_bias[{token}]", entry[1], error=RequestError)
        if not -MAX_BIAS <= bias <= MAX_BIAS:
            raise RequestError(f"logit_bias[{token}] is {bias}; a bias must lie in [-100, 100]")
        out[token] = bias
    return tuple(sorted(out.items()))


@dataclass(frozen=True)
class SamplingParams:
    """How one request decodes.

    max_new_tokens: most tokens generated per sample (>= 1).
    temperature: 0 is greedy (argmax); > 0 samples from softmax(logits / temperature).
    top_k: keep the k most likely tokens (0: all). top_p: keep the smallest set of most likely
        tokens whose probability reaches top_p (1.0: all). Applied in that order, as transformers does.
    seed: makes sampling reproducible: the same request with the same seed gives the same tokens
        whatever else is batched with it. None: the engine draws one from its own seed.
    stop_token_ids: generating one of these ends the sample (the stop token is emitted).
    n: parallel samples; each forks from the prompt with `seq_clone` and decodes on its own stream.
    ignore_eos: False (the default) also stops at the model's EOS ids (`model.eos_token_ids`,
        merged in by `Engine.submit`), as vLLM and transformers `generate` do; True decodes past
        them (stop_token_ids still stop). Models without EOS ids (the random-weight presets) stop
        at stop_token_ids only.
    logprobs: None (off), or k in [0, MAX_LOGPROBS]: each event carries its token's log-probability
        and the k most likely (token, logprob) pairs (`Event.logprobs`).
    prompt_logprobs: None (off), or k in [0, MAX_LOGPROBS]: the prompt is scored teacher-forced,
        each prompt token's log-probability given its prefix and the k most likely at its position
        (`Event.prompt_logprobs`, on sample 0's first event; entry 0 is None: it has no prefix).
        Both are log_softmax of the model's raw float32 logits, before temperature, top-k and top-p
        (vLLM's default "raw" logprobs), so they do not depend on how the token was sampled. A
        speculating engine refuses both.
    presence_penalty, frequency_penalty: in [-2, 2] (OpenAI's); each output token's logit drops
        by presence_penalty once it has been generated and by frequency_penalty times how often.
    repetition_penalty: in (0, 100], 1 off (transformers' and vLLM's): the logit of every token
        of the prompt or the output is divided by it when positive, multiplied when not.
    min_p: in [0, 1], 0 off: tokens less likely than min_p times the most likely are dropped
        (after temperature, top-k and top-p, as transformers' MinPLogitsWarper).
    min_tokens: the stop ids (stop_token_ids and the model's EOS) cannot be sampled before this
        many tokens (at most max_new_tokens).
    logit_bias: {token id: bias in [-100, 100]} added to the logits (OpenAI's), at most
        MAX_LOGIT_BIAS entries; ids are checked against the vocabulary by `Engine.submit`.
        Logit bias, min_tokens, then repetition, frequency and presence penalties are applied in
        vLLM's order, on the device, only in steps where some row uses them; logprobs stay raw.
    constraint: a `batchkv.executor.constraints.Constraint` (JSON schema, regex, choices or an
        EBNF grammar): every sampled token keeps the output a prefix of the language; the sample
        ends "stop" once the grammar is complete and a stop id or nothing else can follow, and
        "grammar" if no token can continue it. Needs `Engine.use_tokenizer`.
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    n: int = 1
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    constraint: object | None = None
    __slots__ = ("__dict__", "adjusts_logits", "adjusts_sampling", "greedy", "scores")  # `_derive`'s

    def __post_init__(self) -> None:
        def put(name: str, value: object) -> object:
            object.__setattr__(self, name, value)
            return value

        put("stop_token_ids", _int_tuple(self.stop_token_ids, "stop_token_ids"))
        put("max_new_tokens", int_arg("max_new_tokens", self.max_new_tokens, 1, error=RequestError))
        put("temperature", real_arg("temperature", self.temperature, error=RequestError))
        if self.temperature < 0.0:
            raise RequestError(f"temperature is {self.temperature}; use 0 (greedy) or a positive value")
        why = " (0: off; any k at or past the vocabulary keeps every token)"
        put("top_k", int_arg("top_k", self.top_k, 0, MAX_TOP_K, error=RequestError, why=why))
        put("top_p", real_arg("top_p", self.top_p, error=RequestError))
        if not 0.0 < self.top_p <= 1.0:
            raise RequestError(f"top_p is {self.top_p!r}; it must lie in (0, 1] (1.0 turns it off)")
        if self.seed is not None:
            put("seed", int_arg("seed", self.seed, 0, MAX_SEED, error=RequestError, why=" (or None)"))
        put("n", int_arg("n", self.n, 1, MAX_SAMPLE_ROWS, error=RequestError, why=" parallel samples"))
        if not isinstance(self.ignore_eos, bool):
            raise RequestError(f"ignore_eos is {self.ignore_eos!r}; use True or False")
        why = " alternatives per token (or None: off)"
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                put(name, int_arg(name, getattr(self, name), 0, MAX_LOGPROBS, error=RequestError, why=why))
        self._check_penalties(put)
        self._derive()

    def _check_penalties(self, put) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = put(name, real_arg(name, getattr(self, name), error=RequestError))
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise RequestError(f"{name} is {value}; it must lie in [-2, 2] (0 turns it off)")
        value = put("repetition_penalty", real_arg("repetition_penalty", self.repetition_penalty, error=RequestError))
        if not 0.0 < value <= MAX_REPETITION_PENALTY:
            raise RequestError(f"repetition_penalty is {value}; it must lie in (0, 100] (1 turns it off)")
        value = put("min_p", real_arg("min_p", self.min_p, error=RequestError))
        if not 0.0 <= value <= 1.0:
            raise RequestError(f"min_p is {value}; it must lie in [0, 1] (0 turns it off)")
        why = f" (at most max_new_tokens={self.max_new_tokens})"
        put("min_tokens", int_arg("min_tokens", self.min_tokens, 0, self.max_new_tokens, error=RequestError, why=why))
        put("logit_bias", _logit_bias(self.logit_bias))
        if self.constraint is not None:
            from batchkv.executor.constraints import Constraint  # the module imports xgrammar only when used

            if not isinstance(self.constraint, Constraint):
                raise RequestError(
                    f"constraint is a {type(self.constraint).__name__}; pass a Constraint "
                    "(Constraint.json_schema, .regex, .choice or .grammar) or None"
                )

    def stopping_at(self, eos_ids: Sequence[int]) -> SamplingParams:
        """These params with the model's `eos_ids` added to stop_token_ids, unless ignore_eos."""
        extra = tuple(e for e in eos_ids if e not in self.stop_token_ids)
        if self.ignore_eos or not extra:
            return self
        return replace(self, stop_token_ids=self.stop_token_ids + extra)

    def __reduce__(self) -> tuple:
        """Pickled as its fields (rebuilt through `__init__`: the frozen slots are derived again)."""
        return (type(self), tuple(getattr(self, f.name) for f in fields(self)))

    def _derive(self) -> None:
        """The flags a step reads for every row, computed once (slots, not properties: a plain
        attribute read per row per step, no call; not fields, so equality, repr, replace() and
        `__dict__` leave them out): greedy (temperature 0); adjusts_logits (a penalty, min_tokens or
        logit_bias changes the logits); adjusts_sampling (adjusts_logits, min_p or a constraint);
        scores (logprobs or prompt_logprobs asked)."""
        adjusts_logits = bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
            or self.min_tokens or self.logit_bias
        )  # fmt: skip
        object.__setattr__(self, "greedy", self.temperature == 0.0)
        object.__setattr__(self, "adjusts_logits", adjusts_logits)
        object.__setattr__(self, "adjusts_sampling", adjusts_logits or self.min_p > 0.0 or self.constraint is not None)
        object.__setattr__(self, "scores", self.logprobs is not None or self.prompt_logprobs is not None)


@dataclass(frozen=True)
class Request:
    """A prompt of token ids and how to continue it.

    rope_offset: RoPE index t of the first prompt token; prompt token i takes (t0 + i, 0, 0) and
    each generated token the next t. The KV position always starts at 0: the two are tracked apart.

    priority: lower runs first (vLLM's convention; default 0). Strict and without preemption: waiting
    requests are admitted in priority order (arrival order within one), and a step takes prompt
    chunks and decode rows only of the most urgent priority that holds a column; a request of a
    later priority keeps its column and tokens, paused, until none more urgent is admitted. Meant
    for background work beside interactive traffic (long batch jobs at priority 1): it can wait as
    long as more urgent requests keep coming.

    Example:
        Request([151644, 872, 198], SamplingParams(max_new_tokens=32, temperature=0.7, seed=1))
    """

    prompt_ids: Sequence[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    rope_offset: int = 0
    priority: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_ids", _int_tuple(self.prompt_ids, "prompt_ids"))
        if not isinstance(self.params, SamplingParams):
            raise RequestError(f"params is a {type(self.params).__name__}; pass a SamplingParams")
        why = " (a RoPE index, bounded like positions)"
        rope_offset = int_arg("rope_offset", self.rope_offset, 0, MAX_POSITIONS, error=RequestError, why=why)
        object.__setattr__(self, "rope_offset", rope_offset)
        priority = int_arg("priority", self.priority, -MAX_PRIORITY - 1, MAX_PRIORITY, error=RequestError,
                           why=" (lower runs first; 0 is the default)")  # fmt: skip
        object.__setattr__(self, "priority", priority)


@dataclass(frozen=True)
class Logprobs:
    """One token's log-probability (natural log, float32 arithmetic) and the `top` most likely
    (token, logprob) pairs at its position, most likely first (k of them: the request's k)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


_EventFields = namedtuple(
    "_EventFields",
    ("request_id", "token", "finish_reason", "sample", "logprobs", "prompt_logprobs"),
    defaults=(None, 0, None, None),
)


class Event(_EventFields):
    """One streamed token of one sample of a request.

    token is None only for a cancellation (finish_reason "cancelled"). finish_reason is None until
    the sample's last event, then one of stop | length | capacity | cancelled. sample is the index
    of the parallel sample (0 when n == 1). logprobs: the token's `Logprobs` when the request asked
    (`SamplingParams.logprobs`). prompt_logprobs: on sample 0's first event when the request asked
    (`SamplingParams.prompt_logprobs`), one entry per prompt token, the first None.

    Frozen, with the fields, defaults, equality, hash and repr of a frozen dataclass
    (`dataclasses.replace` and `fields` work on it), stored as a tuple: a step makes one per
    decoding row, and `events` builds a step's in one C-level pass (no per-field `__init__`, no
    instance dict), which costs about half of filling a dataclass's.
    """

    __slots__ = ()
    request_id: int
    token: int | None
    finish_reason: str | None
    sample: int
    logprobs: Logprobs | None
    prompt_logprobs: tuple[Logprobs | None, ...] | None


# dataclasses' view of it (fields, replace, asdict, FrozenInstanceError on assignment); construction,
# equality, hash and repr stay the tuple's (the same values a frozen dataclass's would give).
Event = dataclass(frozen=True, init=False, repr=False, eq=False)(Event)


def events(
    request_ids: list[int], tokens: list[int], reasons: list[str | None], samples: list[int], logprobs: list
) -> list[Event]:
    """One `Event` per row of the lists (no prompt_logprobs): equal to `Event(...)` of each row,
    made as tuples in one pass (`tuple.__new__` mapped over the zipped rows: no Python per row)."""
    if not len(request_ids) == len(tokens) == len(reasons) == len(samples) == len(logprobs):
        raise ValueError("events: the row lists differ in length")
    rows = zip(request_ids, tokens, reasons, samples, logprobs, repeat(None))
    return list(map(tuple.__new__, repeat(Event), rows))


@dataclass
class Output:
    """Every token and the finish reason of each sample of one request, gathered from events;
    each sample's `Logprobs` (empty lists unless asked) and the prompt's (None unless asked)."""

    tokens: list[list[int]]
    finish_reasons: list[str | None]
    logprobs: list[list[Logprobs]] = field(default_factory=list)
    prompt_logprobs: list[Logprobs | None] | None = None

    def __post_init__(self) -> None:
        if not self.logprobs:  # one list per sample, as tokens
            self.logprobs = [[] for _ in self.tokens]

    @property
    def finished(self) -> bool:
        return all(reason is not None for reason in self.finish_reasons)


def gather(events: Iterable[Event], n: dict[int, int] | None = None) -> dict[int, Output]:
    """Group events by request: `{request_id: Output}`. `n` gives samples per request (default: seen)."""
    out: dict[int, Output] = {}
    for ev in events:
        size = max((n or {}).get(ev.request_id, 1), ev.sample + 1)
        entry = out.setdefault(ev.request_id, Output([], []))
        while len(entry.tokens) < size:
            entry.tokens.append([])
            entry.finish_reasons.append(None)
            entry.logprobs.append([])
        if ev.token is not None:
            entry.tokens[ev.sample].append(ev.token)
        if ev.logprobs is not None:
            entry.logprobs[ev.sample].append(ev.logprobs)
        if ev.prompt_logprobs is not None:
            entry.prompt_logprobs = list(ev.prompt_logprobs)
        if ev.finish_reason is not None:
            entry.finish_reasons[ev.sample] = ev.finish_reason
    return out


def fit_problem(request: Request, cache, vocab_size: int, max_step_tokens: int, speculating: bool) -> str | None:
    """Why `request` can never run on an engine with this `cache` (a `BatchedSequenceCache`),
    vocabulary and step budget (speculating: logprobs are refused), or None: `Engine.submit`'s
    refusals of what the store and the step decide, first to last."""
    prompt, params = request.prompt_ids, request.params
    reach = min(cache.capacity, len(prompt) + params.max_new_tokens - 1)  # what one sample can hold
    held = cache.config.pool_rows - cache.config.scratch_rows
    if not prompt:
        return "the prompt is empty; give at least one token id"
    if len(prompt) + 1 > cache.capacity:
        return (
            f"the prompt has {len(prompt)} tokens and capacity is {cache.capacity}, leaving no position "
            f"for a generated token (shorten the prompt to {cache.capacity - 1} or raise capacity)"
        )
    if params.n > cache.max_seqs:
        return f"n={params.n} samples need {params.n} columns; max_seqs is {cache.max_seqs} (lower n)"
    if cache.config.pool_rows and params.n * reach > held:
        return (
            f"its {params.n} sample(s) can reach {reach} positions each, more than the store's "
            f"{held} together (lower max_new_tokens or n, or give the store more positions)"
        )
    if params.n > max_step_tokens:
        return (
            f"n={params.n} samples sample in one step, whose budget is max_step_tokens="
            f"{max_step_tokens} (lower n or raise max_step_tokens)"
        )
    if min(prompt) < 0 or max(prompt) >= vocab_size:
        bad = next(t for t in prompt if not 0 <= t < vocab_size)
        return f"prompt token id {bad} is outside the vocabulary [0, {vocab_size})"
    if params.scores and speculating:
        return (
            "logprobs and prompt_logprobs are not computed under speculative decoding (a verify step keeps "
            "no logits); drop them, or serve this request from an engine without speculative="
        )
    return None


class StepModel(Protocol):
    """What the engine drives (see `batchkv.models`): a forward over one packed step and the
    geometry its cache needs. An `nn.Module` or a wrapper holding modules (e.g. `HFModel`)."""

    vocab_size: int
    device: torch.device

    def cache_spec(self) -> dict: ...

    def __call__(
        self, input_ids: torch.Tensor, indexes: torch.Tensor, cache: BatchedSequenceCache, logits_rows: torch.Tensor
    ) -> torch.Tensor: ...
