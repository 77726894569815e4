"""Structured outputs on a real trained chat model (SmolLM2-135M-Instruct) through the official
`openai` client: 20 json_schema requests (objects, arrays, enums, nested required fields), half
streamed, every output parsed and validated with jsonschema; json_object; a regex and a choice."""

from __future__ import annotations

import json
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest
import regex

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

from tests.real_model import gguf_path, model_dir  # noqa: E402
from tests.serve_helpers import Server, chat_text  # noqa: E402

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0,
                                                                         "maximum": 120}},
    "required": ["name", "age"],
    "additionalProperties": False,
}  # fmt: skip
SCHEMAS = [
    ("Describe a person.", PERSON),
    ("Pick a colour.", {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}},
                        "required": ["colour"], "additionalProperties": False}),
    ("List three fruits.", {"type": "object", "properties": {"fruits": {"type": "array", "minItems": 3, "maxItems": 3,
                            "items": {"type": "string", "maxLength": 12}}}, "required": ["fruits"],
                            "additionalProperties": False}),
    ("Is water wet?", {"type": "object", "properties": {"answer": {"type": "boolean"}, "confidence": {"type": "number",
                       "minimum": 0, "maximum": 1}}, "required": ["answer"], "additionalProperties": False}),
    ("Describe a team of two people.", {"type": "object", "properties": {"team": {"type": "string", "maxLength": 16},
                                        "members": {"type": "array", "items": PERSON, "minItems": 2, "maxItems": 2}},
                                        "required": ["team", "members"], "additionalProperties": False}),
]  # fmt: skip


@pytest.fixture(scope="module")
def server():
    path = gguf_path()  # skips without the package
    model_dir()
    engine = ("--max-seqs", "10", "--capacity", "512", "--max-step-tokens", "256", "--prefill-chunk", "128")
    srv = Server(str(path), "--served-model-name", "smollm2", *engine, "--threads", "2", "--dtype", "float32")
    yield srv.wait(timeout=300)
    code, out = srv.stop(signal.SIGINT)
    assert code == 0, out


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600)


def ask(client, question: str, stream: bool, **kwargs) -> tuple[str, str]:
    args = {"model": "smollm2", "messages": [{"role": "user", "content": question}], "max_tokens": 160, **kwargs}
    return chat_text(client, args, stream)


def test_twenty_json_schema_requests_parse_and_validate_streamed_and_not(client):
    jobs = []
    for i in range(20):
        question, schema = SCHEMAS[i % len(SCHEMAS)]
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}}
        jobs.append((question, schema, i % 2 == 1, {"response_format": fmt, "temperature": 0.7, "seed": i}))
    with ThreadPoolExecutor(10) as pool:
        answers = list(pool.map(lambda job: ask(client, job[0], job[2], **job[3]), jobs))
    for (_, schema, _, _), (text, finish) in zip(jobs, answers, strict=True):
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), schema)


def test_json_object_regex_and_choice_on_the_real_model(client):
    question = "Give a short JSON object with the keys city and country for Paris."
    text, finish = ask(client, question, False, response_format={"type": "json_object"}, temperature=0, max_tokens=300)
    assert finish == "stop" and isinstance(json.loads(text), dict), text
    pattern = r"[0-9]{3}-[0-9]{4}"
    text, finish = ask(client, "Make up a phone number.", True, extra_body={"guided_regex": pattern}, temperature=0)
    assert finish == "stop" and regex.fullmatch(pattern, text)
    options = ["Paris", "London", "Berlin"]
    text, finish = ask(client, "What is the capital of France?", False, extra_body={"guided_choice": options},
                       temperature=0)  # fmt: skip
    assert finish == "stop" and text in options


def test_a_suffix_is_refused_naming_it_since_smollm2s_tokenizer_has_no_fill_in_the_middle_tokens(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="smollm2", prompt="def add(a, b):", suffix="\n    return c", max_tokens=8)
    assert info.value.body["param"] == "suffix" and "fill-in-the-middle" in info.value.body["message"]
