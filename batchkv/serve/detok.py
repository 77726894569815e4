"""Token ids to text, one token at a time, with stop strings.

`IncrementalDetokenizer` turns a growing list of token ids into text deltas whose concatenation
is the text of the whole list. Each step decodes a short window of ids twice (up to the read
offset, and through the new token) and releases the difference; while the window ends inside a
multi-byte character the decode ends in U+FFFD and nothing is released, so a character split
over tokens comes out whole. The window starts with up to `CONTEXT` prompt tokens, so tokenizers
that drop a leading space when decoding a word on its own (SentencePiece) still give the space.

`StopMatcher` sits after it: text that could still be the start of a stop string is held back;
once a stop string appears, the text before it is released, nothing after it ever is, and
`stopped` is set. A stop string may span any number of tokens. The stop strings are one
Aho-Corasick automaton (`StopStrings`, built once per request and shared by its choices), so each
character costs amortised O(1) however many stop strings there are, and the text held back is
exactly the automaton state's depth (the longest tail that begins some stop string). The cut is
where a stop string first completes (the longest of those completing there), the same whatever
the deltas' boundaries.

The server's windows are decoded by the Rust tokenizer directly where that is the same as the
tokenizer's `decode` (`fast_decoder`): two calls of about a microsecond per token. Where the
tokenizers library has its own incremental decoder (`DecodeStream`, tokenizers 0.21 and later; the
same windows, kept in Rust), `StreamDetokenizer` takes one call per token instead, and the Python
around it is a list append (`detokenizer` picks it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

CONTEXT = 5  # prompt tokens decoded ahead of the generated ones
REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Text deltas of generated tokens. `decode(ids) -> str` is the tokenizer's own decode.

    >>> detok = IncrementalDetokenizer(lambda ids: tokenizer.decode(ids), prompt_ids)
    >>> text = "".join(detok.add(t) for t in tokens) + detok.flush()   # == decode(tokens)
    """

    def __init__(self, decode: Callable[[list[int]], str], prompt_ids: Sequence[int] = ()) -> None:
        self.decode = decode
        context = list(prompt_ids[-CONTEXT:])
        if context and decode(context).endswith(REPLACEMENT):
            context = []  # the prompt ends inside a character: its bytes would merge with ours
        self.ids = context
        self.prefix = 0  # ids[prefix:read] decode to text already released (the window's head)
        self.read = len(context)

    def add(self, token: int) -> str:
        """Append one token; returns the text it completes (possibly empty)."""
        self.ids.append(token)
        return self._advance(final=False)

    def flush(self) -> str:
        """Text still held at the end of generation (an unfinished character decodes as U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        if self.read == len(self.ids):
            return ""
        before = self.decode(self.ids[self.prefix : self.read])
        text = self.decode(self.ids[self.prefix :])
        if not final and (len(text) <= len(before) or text.endswith(REPLACEMENT)):
            return ""  # nothing new yet, or the window ends inside a character
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(before) :]


class StopStrings:
    """The Aho-Corasick automaton of a set of stop strings (empty strings are ignored).

    States are trie nodes; `depth[s]` is the length of the prefix node s spells, `match[s]` the
    length of the longest stop string that is a suffix of it (0: none). Building costs O(total
    characters); `step` is amortised O(1) per character.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.goto: list[dict[str, int]] = [{}]
        self.depth, self.match = [0], [0]
        for stop in stops:
            node = 0
            for ch in stop:
                nxt = self.goto[node].get(ch)
                if nxt is None:
                    nxt = self.goto[node][ch] = len(self.goto)
                    self.goto.append({})
                    self.depth.append(self.depth[node] + 1)
                    self.match.append(0)
                node = nxt
            if stop:
                self.match[node] = len(stop)
        self.fail = [0] * len(self.goto)
        queue = list(self.goto[0].values())  # breadth first (fail links point shallower); depth 1 fails to 0
        for node in queue:
            for ch, child in self.goto[node].items():
                self.fail[child] = self.step(self.fail[node], ch)
                self.match[child] = max(self.match[child], self.match[self.fail[child]])
                queue.append(child)

    def __bool__(self) -> bool:
        return len(self.goto) > 1

    def step(self, state: int, ch: str) -> int:
        """The state after `ch`."""
        goto, fail = self.goto, self.fail
        while state and ch not in goto[state]:
            state = fail[state]
        return goto[state].get(ch, 0)


class StopMatcher:
    """Cuts a text stream at the first occurrence of any stop string.

    >>> m = StopMatcher(["\\n\\n"]); m.feed("a\\n") + m.feed("\\nb")   # -> "a"; m.stopped is True
    """

    def __init__(self, stops: Sequence[str] | StopStrings) -> None:
        self.automaton = stops if isinstance(stops, StopStrings) else StopStrings(stops)
        self.active = bool(self.automaton)  # any stop string at all (asked once, not per token)
        self.state = 0
        self.held = ""
        self.stopped = False

    def feed(self, delta: str) -> str:
        """Add text; returns what can be released now (never text from a stop string on)."""
        if not self.active:
            return delta
        if self.stopped:
            return ""
        text, automaton, state = self.held + delta, self.automaton, self.state
        for i in range(len(self.held), len(text)):
            state = automaton.step(state, text[i])
            if automaton.match[state]:
                self.stopped, self.held = True, ""
                return text[: i + 1 - automaton.match[state]]
        self.state = state
        keep = automaton.depth[state]
        self.held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """The held-back tail once generation ended without a stop string."""
        text, self.held = self.held, ""
        return "" if self.stopped else text


def fast_decoder(tokenizer: Any, skip_special_tokens: bool) -> Callable[[list[int]], str] | None:
    """The Rust tokenizer's own `decode`, when it gives exactly what `tokenizer.decode(ids,
    skip_special_tokens=..., clean_up_tokenization_spaces=False)` gives: `tokenizer` is transformers'
    fast tokenizer with its own `decode` (which then calls that Rust decode after some Python per
    call: about 7 us of a 1.3 us call on this project's CPU). None for any other tokenizer."""
    try:
        from transformers import PreTrainedTokenizerFast
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    except ImportError:  # no transformers: no fast tokenizer either
        return None
    kind = type(tokenizer)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (not isinstance(tokenizer, PreTrainedTokenizerFast) or backend is None
            or kind._decode is not PreTrainedTokenizerFast._decode
            or kind.decode is not PreTrainedTokenizerBase.decode):  # fmt: skip
        return None
    decode = backend.decode
    return lambda ids: decode(ids, skip_special_tokens=skip_special_tokens)


class StreamDetokenizer(IncrementalDetokenizer):
    """`IncrementalDetokenizer`'s deltas from the Rust tokenizer's own incremental decoder
    (`tokenizers.decoders.DecodeStream`: the same two-window algorithm, one call per token). The
    ids since the last released text are kept here too, for `flush` (the stream never releases an
    unfinished character) and for a step the stream refuses (then the two-decode window is used)."""

    def __init__(
        self, backend: Any, stream: Any, decode: Callable[[list[int]], str], prompt_ids: Sequence[int]
    ) -> None:
        super().__init__(decode, prompt_ids)  # ids[prefix:read] decode to text already released, ids[read:] held
        self.backend, self.stream = backend, stream
        for token in self.ids:  # the stream's window starts after the context too (one id a call: any version)
            stream.step(backend, token)

    def add(self, token: int) -> str:
        """Append one token; returns the text it completes (possibly empty)."""
        ids = self.ids
        ids.append(token)
        if self.stream is None:
            return self._advance(final=False)
        try:
            text = self.stream.step(self.backend, token)
        except Exception:  # a window the Rust stream refuses: the two decodes from here on
            self.stream = None
            return self._advance(final=False)
        if text is None:
            return ""
        if self.prefix > 64:  # keep the list short: only the window is ever decoded again
            del ids[: self.read]
            self.read = 0
        self.prefix, self.read = self.read, len(ids)
        return text


def detokenizers(
    tokenizer: Any, skip_special_tokens: bool, decode: Callable[[list[int]], str]
) -> Callable[[Sequence[int]], IncrementalDetokenizer]:
    """prompt ids -> a detokenizer whose text is `decode`'s (`tokenizer.decode` with the job's
    options): `StreamDetokenizer` where the Rust decode is the same as `decode` (`fast_decoder`)
    and tokenizers has `DecodeStream`, `IncrementalDetokenizer` over the Rust decode where only
    that holds, else `IncrementalDetokenizer` over `decode`."""
    fast = fast_decoder(tokenizer, skip_special_tokens)
    if fast is None:
        return lambda prompt: IncrementalDetokenizer(decode, prompt)
    try:
        from tokenizers.decoders import DecodeStream
    except ImportError:  # tokenizers before 0.21
        return lambda prompt: IncrementalDetokenizer(fast, prompt)
    backend = tokenizer.backend_tokenizer
    return lambda prompt: StreamDetokenizer(
        backend, DecodeStream(skip_special_tokens=skip_special_tokens), fast, prompt
    )
