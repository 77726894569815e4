"""Structured outputs and the sampling parameters through `batchkv serve` (a tiny transformers
Qwen3 with random weights and a tokenizer trained here), driven by the official `openai` client:
response_format json_schema / json_object, vLLM's structured_outputs and guided_* fields, streamed
and not, every output validated with jsonschema or the regex; penalties, min_p, min_tokens and
logit_bias accepted; and each refusal a 400 naming its field."""

from __future__ import annotations

import json
import signal

import pytest
import regex

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

from tests.serve_helpers import Server, chat_text, error, make_model_dir, make_tokenizer  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "colour": {"enum": ["red", "green", "blue"]},
        "sizes": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3},
    },
    "required": ["ok", "colour", "sizes"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Hello world, describe a fox as JSON."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_model_dir(tmp_path_factory.mktemp("qwen3-structured"))
    engine = ("--max-seqs", "4", "--capacity", "256", "--max-step-tokens", "64", "--prefill-chunk", "32")
    srv = Server(str(model), "--served-model-name", "tiny", *engine)
    yield srv.wait()
    code, out = srv.stop(signal.SIGTERM)
    assert code == 0, out


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def chat(client, stream: bool = False, **kwargs) -> tuple[str, str]:
    """(text, finish reason) of one chat completion, streamed or not."""
    args = {"model": "tiny", "messages": MESSAGES, "max_tokens": 80, "temperature": 0.8, "seed": 1, **kwargs}
    return chat_text(client, args, stream)


@pytest.mark.parametrize("stream", [False, True])
def test_response_format_json_schema_gives_json_that_validates(client, stream):
    fmt = {"type": "json_schema", "json_schema": {"name": "fox", "schema": SCHEMA, "strict": True}}
    for seed in range(3):
        text, finish = chat(client, stream, response_format=fmt, extra_body={"seed": seed})
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_regex_choice_and_grammar_fields(client):
    tokenizer = make_tokenizer()  # a nudge toward closing quotes keeps the random model's keys short
    closing = {str(tokenizer.convert_tokens_to_ids(t)): 5.0 for t in ('"', "}")}
    text, finish = chat(client, response_format={"type": "json_object"}, logit_bias=closing, max_tokens=120)
    if finish == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # the random model may write one long key; every prefix still parses as the start of an object
        assert finish == "length" and text.startswith("{")
    text, finish = chat(client, extra_body={"guided_regex": r"[a-f]{3}-[0-9]{2}"})
    assert finish == "stop" and regex.fullmatch(r"[a-f]{3}-[0-9]{2}", text)
    text, finish = chat(client, extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe so"]}})
    assert finish == "stop" and text in ("yes", "no", "maybe so")
    text, finish = chat(client, extra_body={"guided_choice": ["left", "right"]}, stream=True)
    assert finish == "stop" and text in ("left", "right")
    text, finish = chat(client, extra_body={"guided_grammar": 'root ::= "<" [xyz]+ ">"'})
    assert finish == "stop" and regex.fullmatch(r"<[xyz]+>", text)


def test_completions_take_a_guided_json_schema_and_n_2(server):
    body = {"prompt": "A fox:", "max_tokens": 80, "n": 2, "temperature": 0.9, "seed": 4, "guided_json": SCHEMA}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["text"]), SCHEMA)


def test_sampling_parameters_are_accepted(client):
    extra = {"repetition_penalty": 1.3, "min_p": 0.1, "min_tokens": 5, "top_k": 20}
    out = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=12, temperature=0.7, seed=3, presence_penalty=0.5,
        frequency_penalty=0.5, logit_bias={"7": -100}, extra_body=extra,
    )  # fmt: skip
    assert out.choices[0].finish_reason in ("stop", "length") and out.usage.completion_tokens >= 5


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -9}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_p": 2}, "min_p"),
        ({"min_tokens": 500, "max_tokens": 10}, "min_tokens"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"3": 500}}, "logit_bias"),
        ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
         "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"guided_grammar": "root ::= missing"}, "guided_grammar"),
        ({"guided_choice": []}, "guided_choice"),
        ({"structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"guided_json": "{not json"}, "guided_json"),
    ],
)  # fmt: skip
def test_bad_values_are_400s_naming_the_field(server, fields, param):
    body = {"messages": MESSAGES, "max_tokens": 4, **fields}
    refused = error(httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60), 400)
    assert refused["param"] == param, refused


def test_tokenize_detokenize_and_version_answer_in_vllms_shapes(server):
    from tests.serve_helpers import make_tokenizer

    tokenizer = make_tokenizer()
    text = "Hello world, hello batchkv!"
    r = httpx.post(server.url + "/tokenize", json={"prompt": text, "return_token_strs": True}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tokenizer.encode(text) and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 256 and body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    chat = httpx.post(server.url + "/tokenize", json={"messages": MESSAGES}, timeout=60).json()
    rendered = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert chat["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)
    back = httpx.post(server.url + "/detokenize", json={"tokens": body["tokens"]}, timeout=60)
    assert back.status_code == 200 and back.json() == {"prompt": text}
    assert error(httpx.post(server.url + "/detokenize", json={"tokens": [10**6]}, timeout=60), 400)["param"] == "tokens"
    assert error(httpx.post(server.url + "/tokenize", json={}, timeout=60), 400)["param"] == "prompt"
    assert error(httpx.post(server.url + "/tokenize", json={"prompt": "x", "bogus": 1}, timeout=60), 400)
    version = httpx.get(server.url + "/version", timeout=60).json()
    assert version == {"version": __import__("batchkv").__version__}


def test_echo_puts_the_prompt_before_the_text_and_special_tokens_can_be_kept(server):
    from tests.serve_helpers import make_tokenizer

    tokenizer = make_tokenizer()
    base = {"prompt": "Hello world", "max_tokens": 6, "temperature": 0}
    plain = httpx.post(server.url + "/v1/completions", json=base, timeout=60).json()["choices"][0]["text"]
    echoed = httpx.post(server.url + "/v1/completions", json={**base, "echo": True}, timeout=60).json()
    assert echoed["choices"][0]["text"] == "Hello world" + plain
    with httpx.stream("POST", server.url + "/v1/completions", json={**base, "echo": True, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == "Hello world" + plain
    refused = error(httpx.post(server.url + "/v1/completions", json={**base, "echo": True, "logprobs": 1}), 400)
    assert refused["param"] == "echo"
    special = [tokenizer.convert_tokens_to_ids("<|im_start|>")]  # a special token the answer must show
    body = {**base, "logit_bias": {str(special[0]): 100}, "max_tokens": 2, "ignore_eos": True}
    kept = httpx.post(server.url + "/v1/completions", json={**body, "skip_special_tokens": False}, timeout=60)
    dropped = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert kept.json()["choices"][0]["text"] == "<|im_start|><|im_start|>"
    assert dropped.json()["choices"][0]["text"] == ""
