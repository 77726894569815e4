"""Token ids to text, one token at a time, with stop strings.

`IncrementalDetokenizer` turns a growing list of token ids into text deltas whose concatenation
is the text of the whole list. Each step decodes a short window of ids twice (up to the read
offset, and through the new token) and releases the difference; while the window ends inside a
multi-byte character the decode ends in U+FFFD and nothing is released, so a character split
over tokens comes out whole. The window starts with up to `CONTEXT` prompt tokens, so tokenizers
that drop a leading space when decoding a word on its own (SentencePiece) still give the space.

`StopMatcher` sits after it: text that could still be the start of a stop string is held back;
once a stop string appears, the text before it is released, nothing after it ever is, and
`stopped` is set. A stop string may span any number of tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

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


class StopMatcher:
    """Cuts a text stream at the first occurrence of any stop string.

    >>> m = StopMatcher(["\\n\\n"]); m.feed("a\\n") + m.feed("\\nb")   # -> "a"; m.stopped is True
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.longest = max((len(s) for s in self.stops), default=0)
        self.held = ""
        self.stopped = False

    def feed(self, delta: str) -> str:
        """Add text; returns what can be released now (never text from a stop string on)."""
        if self.stopped:
            return ""
        text = self.held + delta
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, self.held = True, ""
            return text[: min(hits)]
        keep = self._partial(text)
        self.held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """The held-back tail once generation ended without a stop string."""
        text, self.held = self.held, ""
        return "" if self.stopped else text

    def _partial(self, text: str) -> int:
        """Length of the longest suffix of `text` that begins some stop string."""
        for k in range(min(len(text), self.longest - 1), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0
