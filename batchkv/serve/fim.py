"""Completions' `suffix` (OpenAI's insertion): fill in the middle, where the tokenizer has the tokens.

A model trained for fill-in-the-middle reads `PREFIX prompt SUFFIX suffix MIDDLE` and writes the
text between the two; the three markers are single tokens of its vocabulary. The families:
- `starcoder`: `<fim_prefix>`, `<fim_suffix>`, `<fim_middle>` (StarCoder, SantaCoder, the
  StarCoder-tokenizer SmolLM checkpoints);
- `qwen`: `<|fim_prefix|>`, `<|fim_suffix|>`, `<|fim_middle|>` (Qwen2.5-Coder, Qwen3-Coder);
- `deepseek`: `<｜fim▁begin｜>`, `<｜fim▁hole｜>`, `<｜fim▁end｜>` (DeepSeek-Coder).

A tokenizer with none of them (SmolLM2-135M-Instruct's has none) answers a request with `suffix` with
a 400 naming `suffix` and saying why: the model was not trained to insert text. The completion's
text is the middle alone, as OpenAI's is; `echo` with `suffix` is refused (the echoed prompt would
be the marked-up one).
"""

from __future__ import annotations

from typing import Any

from batchkv.serve.protocol import APIError

FORMATS: dict[str, tuple[str, str, str]] = {  # name -> (prefix, suffix, middle) marker tokens
    "starcoder": ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    "qwen": ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    "deepseek": ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),
}


def markers(tokenizer: Any) -> tuple[int, int, int] | None:
    """The (prefix, suffix, middle) token ids of the first family whose three markers are each one
    token of `tokenizer`'s vocabulary, or None."""
    if tokenizer is None:
        return None
    vocab = tokenizer.get_vocab()
    for names in FORMATS.values():
        if all(name in vocab for name in names):
            return vocab[names[0]], vocab[names[1]], vocab[names[2]]
    return None


def insert(prompts: list[list[int]], suffix: str, tokenizer: Any, echo: bool) -> list[list[int]]:
    """Each prompt's token ids as a fill-in-the-middle prompt around `suffix` (a leading BOS stays
    first); APIError(400) naming `suffix` when the tokenizer has no markers or `echo` is asked."""
    if not isinstance(suffix, str):
        raise APIError(400, f"suffix is a {type(suffix).__name__}; give text", param="suffix")
    found = markers(tokenizer)
    if found is None:
        families = ", ".join(f"{names[0]}/{names[1]}/{names[2]}" for names in FORMATS.values())
        raise APIError(
            400,
            "suffix (inserting text) needs a model trained for fill-in-the-middle, whose tokenizer has the "
            f"fill-in-the-middle tokens ({families}); this model's has none: drop suffix",
            param="suffix",
        )
    if echo:
        raise APIError(400, "echo with suffix is not supported (the prompt is marked up); drop one", param="suffix")
    prefix, middle_of, middle = found
    tail = list(tokenizer.encode(suffix, add_special_tokens=False))
    bos = getattr(tokenizer, "bos_token_id", None)
    out = []
    for ids in prompts:
        head = ids[:1] if ids and bos is not None and ids[0] == bos else []
        out.append([*head, prefix, *ids[len(head) :], middle_of, *tail, middle])
    return out
