"""The server's text path without a server: incremental detokenisation against the tokenizer's own
decode, stop strings, and request bodies decoded strictly."""

from __future__ import annotations

import json
import random

import pytest

pytest.importorskip("msgspec")
pytest.importorskip("tokenizers")

from batchkv.serve.detok import IncrementalDetokenizer, StopMatcher, StopStrings
from batchkv.serve.jobs import ModelInfo, completion_prompts, make_job
from batchkv.serve.protocol import (
    NULL_MEANS_DEFAULT,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    decode_body,
    refuse_unsupported,
)
from tests.serve_helpers import make_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def _decode(tokenizer):
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def test_incremental_text_of_random_tokens_equals_the_decode_of_all_of_them(tokenizer):
    rng = random.Random(0)
    decode = _decode(tokenizer)
    for _ in range(30):
        prompt = tokenizer.encode(rng.choice(["Hello", "Café", "日本", "🙂 x"]))
        tokens = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 25))]
        detok = IncrementalDetokenizer(decode, prompt)
        text = "".join(detok.add(t) for t in tokens) + detok.flush()
        assert text == decode(tokens)


def test_a_character_split_over_tokens_comes_out_whole(tokenizer):
    decode = _decode(tokenizer)
    text = "naïve 日本語のテキスト 🙂🚀✨ brûlée"
    tokens = tokenizer.encode(text)
    assert any(decode([t]).endswith("\ufffd") for t in tokens), "the corpus should split some character"
    detok = IncrementalDetokenizer(decode)
    pieces = [detok.add(t) for t in tokens]
    assert "".join(pieces) + detok.flush() == text
    assert not any("\ufffd" in piece for piece in pieces)


def _run(stops, deltas):
    m = StopMatcher(stops)
    out = [m.feed(d) for d in deltas]
    return out, m.flush(), m.stopped


def test_a_stop_string_spanning_deltas_cuts_the_text_before_it():
    out, tail, stopped = _run(["END"], ["abc E", "N", "D and more"])
    assert out == ["abc ", "", ""] and tail == "" and stopped


def test_text_that_could_begin_a_stop_string_is_held_then_released_when_it_does_not():
    out, tail, stopped = _run(["END"], ["x E", "Nd", "!"])
    assert out == ["x ", "ENd", "!"] and not stopped
    out, tail, stopped = _run(["END"], ["x EN"])
    assert out == ["x "] and tail == "EN" and not stopped


def test_the_earliest_of_several_stop_strings_wins():
    out, _, stopped = _run(["world", "lo w"], ["hello world"])
    assert out == ["hel"] and stopped


def test_nothing_comes_out_after_a_stop():
    m = StopMatcher(["."])
    assert m.feed("a.b") == "a" and m.feed("c") == "" and m.flush() == ""


def _first_completed(stops: list[str], text: str) -> tuple[str, bool]:
    """Brute force: the text before the stop string that completes first (the longest one completing
    at that character), and whether one did."""
    for end in range(1, len(text) + 1):
        longest = max((len(s) for s in stops if s and text[:end].endswith(s)), default=0)
        if longest:
            return text[: end - longest], True
    return text, False


def test_the_stop_automaton_cuts_where_a_brute_force_search_does_however_the_text_is_split():
    rng = random.Random(0)
    for _ in range(2000):
        stops = ["".join(rng.choice("ab c") for _ in range(rng.randint(0, 5))) for _ in range(rng.randint(1, 6))]
        text = "".join(rng.choice("abc d") for _ in range(rng.randint(0, 30)))
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 6))))
        deltas = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        out, tail, stopped = _run(stops, deltas)
        assert ("".join(out) + tail, stopped) == _first_completed(stops, text), (stops, deltas)


def test_a_stop_string_inside_a_longer_one_cuts_where_it_completes_whatever_the_deltas():
    for deltas in (["xabcd"], ["xab", "cd"], ["x", "a", "b", "c", "d"]):
        out, _, stopped = _run(["abcd", "bc"], deltas)
        assert "".join(out) == "xa" and stopped


def test_one_automaton_serves_many_choices_each_with_its_own_state():
    automaton = StopStrings([f"never {i}" for i in range(10_000)] + ["END"])
    first, second = StopMatcher(automaton), StopMatcher(automaton)
    assert first.feed("one E") == "one " and second.feed("two EN") == "two "
    assert first.feed("ND") == "" and first.stopped and not second.stopped
    assert second.feed("d") == "ENd" and second.flush() == ""


def test_json_nested_past_the_limit_is_refused_not_a_recursion_error():
    for depth in (10, 5_000):
        raw = b'{"messages": [], "chat_template_kwargs": {"x": ' + b"[" * depth + b"]" * depth + b"}}"
        with pytest.raises(APIError) as info:
            decode_body(raw, ChatCompletionRequest, max_depth=8)
        assert info.value.status == 400 and info.value.code == "json_too_deep"
    raw = b'{"messages": [], "chat_template_kwargs": {"x": [[[]]]}}'  # 5 levels with the body's own
    assert decode_body(raw, ChatCompletionRequest, max_depth=5).chat_template_kwargs == {"x": [[[]]]}
    with pytest.raises(APIError):
        decode_body(raw, ChatCompletionRequest, max_depth=4)


def test_a_body_with_an_unknown_field_is_refused_naming_it():
    with pytest.raises(APIError) as info:
        decode_body(b'{"prompt": "x", "max_tokenz": 3}', CompletionRequest)
    assert info.value.status == 400 and info.value.param == "max_tokenz"


def test_a_field_of_the_wrong_type_is_refused_naming_it():
    with pytest.raises(APIError) as info:
        decode_body(b'{"messages": [], "temperature": "hot"}', ChatCompletionRequest)
    assert info.value.status == 400 and info.value.param == "temperature"


def test_malformed_json_is_refused():
    with pytest.raises(APIError) as info:
        decode_body(b'{"prompt": ', CompletionRequest)
    assert info.value.status == 400 and "JSON" in info.value.message


def test_a_prompt_may_be_text_token_ids_or_a_batch_of_either():
    for raw in (b'"a"', b"[1, 2]", b'["a", "b"]', b"[[1], [2, 3]]"):
        body = decode_body(b'{"prompt": ' + raw + b"}", CompletionRequest)
        assert body.prompt is not None


def test_fields_openai_marks_nullable_take_their_defaults_when_null():
    nulls = {name: None for name in NULL_MEANS_DEFAULT}
    for kind, base in ((CompletionRequest, {"prompt": "x"}), (ChatCompletionRequest, {"messages": []})):
        names = [name for name in nulls if name in kind.__struct_fields__]
        body = decode_body(json.dumps({**base, **{name: None for name in names}}).encode(), kind)
        assert body == decode_body(json.dumps(base).encode(), kind)
        refuse_unsupported(body)
    chat = decode_body(b'{"messages": [], "logprobs": null}', ChatCompletionRequest)
    assert chat.logprobs is False


def test_completions_logprobs_0_asks_for_the_chosen_tokens_logprob_not_for_nothing():
    info = ModelInfo("m", None, capacity=64)
    for raw, k in ((b"0", 0), (b"null", None), (b"5", 5)):
        body = decode_body(b'{"prompt": [1], "max_tokens": 2, "logprobs": ' + raw + b"}", CompletionRequest)
        refuse_unsupported(body)
        job = make_job(body, completion_prompts(body, info), info)
        assert job.logprobs == k and job.requests[0].params.logprobs == k


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b'{"prompt": [1], "logprobs": 6}', "logprobs"),
        (b'{"prompt": [1], "logprobs": -1}', "logprobs"),
        (b'{"messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": 21}', "top_logprobs"),
        (b'{"messages": [{"role": "user", "content": "x"}], "logprobs": true, "top_logprobs": -1}', "top_logprobs"),
        (b'{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}', "top_logprobs"),
    ],
)
def test_logprobs_past_openais_bounds_or_top_logprobs_without_logprobs_is_a_400_naming_the_field(raw, param):
    kind = ChatCompletionRequest if b"messages" in raw else CompletionRequest
    body = decode_body(raw, kind)
    with pytest.raises(APIError) as refused:
        make_job(body, [[1]], ModelInfo("m", None, capacity=64))
    assert refused.value.status == 400 and refused.value.param == param


def test_chat_logprobs_true_without_top_logprobs_asks_for_the_chosen_tokens_only():
    info = ModelInfo("m", None, capacity=64)
    body = decode_body(b'{"messages": [{"role": "user", "content": "x"}], "logprobs": true}', ChatCompletionRequest)
    assert make_job(body, [[1]], info).logprobs == 0
    body = decode_body(b'{"messages": [{"role": "user", "content": "x"}], "top_logprobs": 0}', ChatCompletionRequest)
    assert make_job(body, [[1]], info).logprobs is None


def test_a_negative_prompt_token_id_is_a_400_naming_the_prompt():
    info = ModelInfo("m", None, capacity=64)
    body = decode_body(b'{"prompt": [1, -2], "max_tokens": 3}', CompletionRequest)
    with pytest.raises(APIError) as refused:
        make_job(body, completion_prompts(body, info), info)
    assert refused.value.status == 400 and refused.value.param == "prompt" and "-2" in refused.value.message


def test_priority_reaches_every_request_of_a_job_and_null_means_the_default():
    info = ModelInfo("m", None, capacity=64)
    for raw, priority in ((b"", 0), (b', "priority": null', 0), (b', "priority": 3', 3), (b', "priority": -2', -2)):
        body = decode_body(b'{"prompt": [[1], [2, 3]], "max_tokens": 2, "n": 2' + raw + b"}", CompletionRequest)
        job = make_job(body, completion_prompts(body, info), info)
        assert [r.priority for r in job.requests] == [priority, priority]
    body = decode_body(b'{"messages": [{"role": "user", "content": "x"}], "priority": 1}', ChatCompletionRequest)
    assert make_job(body, [[1]], info).requests[0].priority == 1


@pytest.mark.parametrize("raw", [b"2147483648", b"1.5", b'"1"', b"true"])
def test_a_priority_outside_int32_or_not_an_int_is_a_400_naming_it(raw):
    info = ModelInfo("m", None, capacity=64)
    with pytest.raises(APIError) as refused:
        body = decode_body(b'{"prompt": [1], "max_tokens": 2, "priority": ' + raw + b"}", CompletionRequest)
        make_job(body, completion_prompts(body, info), info)
    assert refused.value.status == 400 and refused.value.param == "priority"
