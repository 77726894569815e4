"""A real trained chat model (SmolLM2-135M-Instruct, from a GGUF file) through batchkv on the CPU:
greedy tokens equal transformers' `generate`, EOS stops by default, n-gram speculation is lossless."""

from __future__ import annotations

import pytest
import torch

from batchkv.executor import Engine, Request, SamplingParams, SpeculativeConfig, gather
from tests.real_model import CHATS, chat_ids, gguf_path, hf_greedy, hf_model, threads, tokenizer

MAX_NEW = 16
ENGINE = {"max_seqs": 8, "capacity": 256, "max_step_tokens": 128, "prefill_chunk": 64}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model():
    gguf_path()  # skips without the package
    from batchkv.models.hf import HFModel

    with threads():
        yield HFModel(hf_model())


@pytest.fixture(scope="module")
def expected(model):
    """transformers' greedy answer to each chat, alone."""
    return [hf_greedy(chat_ids(text), MAX_NEW) for text in CHATS]


def _drive(engine: Engine, arrivals: list[int], requests: list[Request]) -> list[list[int]]:
    """Submit requests[i] at step arrivals[i]; step until done (bounded); tokens by request."""
    ids, events = [-1] * len(requests), []
    for step in range(2000):
        for i, at in enumerate(arrivals):
            if at == step:
                ids[i] = engine.submit(requests[i])
        if step > max(arrivals) and not engine.has_work:
            break
        events += engine.step()
    outputs = gather(events)
    engine.assert_idle()
    return [outputs[rid].tokens[0] for rid in ids]


def _chats(**params) -> list[Request]:
    return [Request(chat_ids(text), SamplingParams(max_new_tokens=MAX_NEW, **params)) for text in CHATS]


def test_greedy_chat_answers_all_at_once_equal_transformers_generate(model, expected):
    got = _drive(Engine(model, **ENGINE), [0] * len(CHATS), _chats())
    assert got == expected
    assert any(tokens[-1] in model.eos_token_ids and len(tokens) < MAX_NEW for tokens in got), "some answer ends"


def test_greedy_chat_answers_arriving_staggered_equal_transformers_generate(model, expected):
    engine = Engine(model, **{**ENGINE, "max_seqs": 4, "max_step_tokens": 48, "prefill_chunk": 16})
    got = _drive(engine, [0, 0, 1, 3, 4, 7, 9, 12], _chats())
    assert got == expected


def test_an_answer_stops_at_the_models_eos_unless_ignore_eos(model):
    prompt = chat_ids(CHATS[0])  # "The capital of France is Paris.<|im_end|>": 8 tokens
    eos = model.eos_token_ids
    assert eos == (tokenizer().convert_tokens_to_ids("<|im_end|>"),)
    engine = Engine(model, **ENGINE)
    engine.submit(Request(prompt, SamplingParams(max_new_tokens=MAX_NEW)))
    engine.submit(Request(prompt, SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)))
    out = gather(engine.run_until_done())
    stopped, past = out[0], out[1]
    assert stopped.finish_reasons == ["stop"] and stopped.tokens[0][-1] in eos
    assert len(stopped.tokens[0]) < MAX_NEW
    assert past.finish_reasons == ["length"] and len(past.tokens[0]) == MAX_NEW
    assert past.tokens[0][: len(stopped.tokens[0])] == stopped.tokens[0]


REPEATS = (
    "Copy this list exactly, then copy it again:\n"
    "apple, river, candle, mountain, violin, harbour, lantern, meadow, copper, falcon\n"
)


def test_ngram_speculation_is_lossless_and_accepts_several_tokens_on_repeated_context(model):
    prompt = chat_ids(REPEATS)
    requests = [Request(prompt, SamplingParams(max_new_tokens=40))]
    plain = _drive(Engine(model, **ENGINE), [0], requests)
    fast = Engine(model, **ENGINE, speculative=SpeculativeConfig("ngram", block_size=8))
    assert _drive(fast, [0], requests) == plain
    accepted = fast.metrics.summary()["spec_accept_len_mean"]
    assert accepted > 1.5, f"{accepted} tokens per verify on a prompt the answer repeats"


def test_from_pretrained_reads_a_gguf_file_with_its_eos_ids_and_max_positions():
    from batchkv.models.hf import HFModel

    model = HFModel.from_pretrained(gguf_path(), dtype=torch.float32)
    assert model.eos_token_ids == (2,) and model.max_positions == 8192
    assert model.cache_spec()["kv_heads"] == 3 and model.cache_spec()["head_dim"] == 64
    assert (model.directory / "tokenizer.json").is_file()
    assert Engine(model, max_seqs=1).cache.capacity == 8192  # the model's limit when none is given


def test_chats_sharing_the_system_prompt_reuse_it_and_still_equal_transformers_generate(model, expected):
    # The chat template puts one system prompt before every message: each request after the first
    # finds it written, in a live prompt or a kept history, and reuses all of it.
    prompts = [chat_ids(text) for text in CHATS]
    shared = next(i for i, column in enumerate(zip(*prompts, strict=False)) if len(set(column)) > 1)
    engine = Engine(model, **{**ENGINE, "max_seqs": 4, "max_step_tokens": 48, "prefill_chunk": 16})
    got = _drive(engine, [0, 3, 6, 9, 12, 15, 18, 21], _chats())
    assert got == expected
    m = engine.metrics.summary()
    assert shared >= 16 and m["prefix_reused_tokens"] >= (len(CHATS) - 1) * shared, (shared, m)
