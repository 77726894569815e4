"""Completions' `suffix` (fill in the middle) through the official `openai` client, on a tiny Qwen3
whose tokenizer carries StarCoder's fill-in-the-middle tokens; refused (a 400 naming suffix) where
the tokenizer has none."""

from __future__ import annotations

import signal

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from batchkv.serve import fim  # noqa: E402
from batchkv.serve.protocol import APIError  # noqa: E402
from tests.serve_helpers import Server, make_model_dir, make_tokenizer  # noqa: E402

STARCODER = fim.FORMATS["starcoder"]
QWEN = fim.FORMATS["qwen"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("qwen3-fim"), special=STARCODER)


@pytest.fixture(scope="module")
def server(model):
    engine = ("--max-seqs", "4", "--capacity", "256", "--max-step-tokens", "64", "--prefill-chunk", "32")
    srv = Server(str(model), "--served-model-name", "tiny", *engine)
    yield srv.wait()
    code, out = srv.stop(signal.SIGTERM)
    assert code == 0, out


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_a_suffix_becomes_the_prefix_suffix_middle_prompt_the_tokenizer_itself_reads(client, model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    prefix, suffix = "Hello world, how", " today?"
    expected = tokenizer.encode(f"{STARCODER[0]}{prefix}{STARCODER[1]}{suffix}{STARCODER[2]}")
    assert [t for t in expected if t in tokenizer.all_special_ids][-3:] == tokenizer.convert_tokens_to_ids(
        list(STARCODER)
    )  # the markers are single special tokens, not spelled out
    args = {"model": "tiny", "max_tokens": 6, "temperature": 0.0, "extra_body": {"return_token_ids": True}}
    text_prompt = client.completions.create(prompt=prefix, suffix=suffix, **args)
    ids_prompt = client.completions.create(prompt=tokenizer.encode(prefix), suffix=suffix, **args)
    for answer in (text_prompt, ids_prompt):
        body = answer.model_dump()
        assert body["choices"][0]["prompt_token_ids"] == expected
        assert answer.usage.prompt_tokens == len(expected)
        assert body["choices"][0]["text"] == tokenizer.decode(body["choices"][0]["token_ids"], skip_special_tokens=True)
    plain = client.completions.create(prompt=prefix, **args).model_dump()
    assert plain["choices"][0]["prompt_token_ids"] == tokenizer.encode(prefix)  # no suffix: no markers


def test_a_streamed_insertion_gives_the_text_the_whole_answer_gives(client):
    args = {"model": "tiny", "prompt": "The quick brown", "suffix": " lazy dog.", "max_tokens": 8, "temperature": 0.0}
    whole = client.completions.create(**args).choices[0].text
    parts = [chunk.choices[0].text for chunk in client.completions.create(stream=True, **args) if chunk.choices]
    assert "".join(parts) == whole and whole


def test_echo_with_a_suffix_is_refused_naming_suffix(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="Hello", suffix="!", echo=True, max_tokens=2)
    assert info.value.body["param"] == "suffix" and "echo" in info.value.body["message"]


def test_a_tokenizer_without_fill_in_the_middle_tokens_refuses_a_suffix_naming_it():
    with pytest.raises(APIError) as info:
        fim.insert([[5, 6]], "end", make_tokenizer(), echo=False)
    assert info.value.param == "suffix" and "fill-in-the-middle" in str(info.value)
    qwen = make_tokenizer(special=QWEN)
    ids = qwen.convert_tokens_to_ids(list(QWEN))
    assert fim.markers(qwen) == tuple(ids)
    assert fim.insert([[5, 6]], "end", qwen, echo=False) == [[ids[0], 5, 6, ids[1], *qwen.encode("end"), ids[2]]]
