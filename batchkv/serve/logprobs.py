"""Engine `Logprobs` as OpenAI writes them: the completions API's legacy object and chat's content list.

- /v1/completions `logprobs: k` (0..5): `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`,
  one entry per generated token; each `top_logprobs` entry maps token text to logprob for the k most
  likely tokens and the chosen one (so up to k + 1 entries, as OpenAI's reference says).
  `text_offset` is the character offset of each token's text, counted from the start of the
  completion over the tokens' own texts (streamed chunks continue where the last one ended).
- /v1/chat/completions `logprobs: true, top_logprobs: k` (0..20): `{"content": [{"token",
  "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}, ...]}], "refusal": null}`.

A token's text is the tokenizer's decode of that one id, special tokens included (the stop id of a
finished choice has an entry, as its id is in `token_ids`); `bytes` are its UTF-8 bytes, taken
from the byte-level vocabulary when the tokenizer is byte-level (GPT-2 style BPE), so a character
split over tokens has each token's own bytes rather than U+FFFD's. Without a tokenizer a token's
text is `token_id:<id>` (vLLM's `return_tokens_as_token_ids` form). Logprobs of -inf (a token the
model gives no mass) are written as -9999.0, as vLLM does: JSON has no infinity.
"""

from __future__ import annotations

import functools
from typing import Any

from batchkv.executor.request import Logprobs

FLOOR = -9999.0  # JSON has no -inf


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-to-unicode map, inverted: the character a byte-level vocabulary writes -> byte."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, extra = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


class TokenText:
    """Text and bytes of single token ids, cached (one decode per id per request)."""

    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self.byte_level = type(decoder).__name__ == "ByteLevel"
        self._text: dict[int, str] = {}

    def text(self, token: int) -> str:
        """The decode of this one id."""
        text = self._text.get(token)
        if text is None:
            if self.tokenizer is None:
                text = f"token_id:{token}"
            else:
                text = self.tokenizer.decode([token], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            self._text[token] = text
        return text

    def bytes(self, token: int) -> list[int]:
        """The token's own UTF-8 bytes (from the byte-level vocabulary where there is one)."""
        if self.byte_level:
            piece, decoder = self.tokenizer.convert_ids_to_tokens(token), _byte_decoder()
            if piece and all(ch in decoder for ch in piece):
                return [decoder[ch] for ch in piece]
        return list(self.text(token).encode("utf-8"))


def _value(logprob: float) -> float:
    return max(logprob, FLOOR)


def completion_logprobs(entries: list[Logprobs], text: TokenText, offset: int = 0) -> tuple[dict[str, Any], int]:
    """The legacy completions `logprobs` object of `entries`, whose first token's text starts at
    character `offset`; returns it and the offset after the last token."""
    tokens, values, tops, offsets = [], [], [], []
    for entry in entries:
        token = text.text(entry.token)
        top = {text.text(t): _value(v) for t, v in entry.top}
        top.setdefault(token, _value(entry.logprob))  # the chosen token is always listed
        tokens.append(token)
        values.append(_value(entry.logprob))
        tops.append(top)
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}, offset


def chat_logprobs(entries: list[Logprobs], text: TokenText) -> dict[str, Any]:
    """Chat's `logprobs` object of `entries`."""

    def one(token: int, logprob: float) -> dict[str, Any]:
        return {"token": text.text(token), "logprob": _value(logprob), "bytes": text.bytes(token)}

    content = [{**one(e.token, e.logprob), "top_logprobs": [one(t, v) for t, v in e.top]} for e in entries]
    return {"content": content, "refusal": None}
