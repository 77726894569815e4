"""`batchkv serve` against hostile and malformed requests, with its default limits: a real server
over a tiny transformers Qwen3, driven by `httpx`. Each test is one defect the server once had
(a 50 MB body accepted, a 10 MB prompt tokenised on the event loop, deep JSON a 500, text/plain
served, `max_completion_tokens: 0` read as unset, a never-admissible batch a 429, request
templates rendered, the Host header unchecked, no request id)."""

from __future__ import annotations

import json
import signal
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from tests.serve_helpers import (  # noqa: E402
    Server,
    assert_health_answered,
    error,
    make_model_dir,
    peak_rss_bytes,
    polling_health,
)

CAPACITY = 512
MAX_WAITING = 8
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_model_dir(tmp_path_factory.mktemp("qwen3-tiny"))
    srv = Server(str(model), "--capacity", str(CAPACITY), "--max-seqs", "2", "--max-waiting", str(MAX_WAITING))
    yield srv.wait()
    code, out = srv.stop(signal.SIGTERM)
    assert code == 0, out
    assert "Traceback" not in out, out


def post(server, path: str, body, **kwargs) -> httpx.Response:
    """POST `body` (a dict as JSON; bytes or an iterator of bytes as they are)."""
    content = json.dumps(body).encode() if isinstance(body, dict) else body
    return httpx.post(server.url + path, content=content, headers=kwargs.pop("headers", JSON), timeout=120, **kwargs)


def chat(**fields) -> dict:
    return {"messages": [{"role": "user", "content": "Hello world"}], "max_tokens": 2, **fields}


def test_a_50_mb_body_is_refused_with_413_at_once_without_the_process_growing(server):
    before = peak_rss_bytes(server.proc.pid)
    body = b'{"prompt": "Hello", "max_tokens": 1, "user": "' + b"x" * 50_000_000 + b'"}'
    start = time.perf_counter()
    r = post(server, "/v1/completions", body)
    elapsed = time.perf_counter() - start
    assert error(r, 413)["code"] == "request_too_large" and "--max-body-bytes" in r.json()["error"]["message"]

    def chunks():  # no Content-Length: refused once the bytes read pass the limit
        for _ in range(50):
            yield b"x" * 1_000_000

    assert error(post(server, "/v1/completions", chunks()), 413)["code"] == "request_too_large"
    grown = peak_rss_bytes(server.proc.pid) - before
    assert elapsed < 10 and grown < 100 * 2**20, (elapsed, grown)  # it once took 89 s and grew 5.9 GB


def test_health_answers_at_once_while_a_10_mb_prompt_is_refused_before_it_is_tokenised(server):
    body = json.dumps({"prompt": "word " * 2_000_000, "max_tokens": 1}).encode()  # encoded before the polling
    r, times = polling_health(server.url, lambda: post(server, "/v1/completions", body))
    refused = error(r, 400)
    assert refused["param"] == "prompt" and "--max-prompt-chars" in refused["message"]
    assert_health_answered(times)


def test_10000_stop_strings_are_refused_naming_the_limit_while_health_answers(server):
    body = json.dumps({"prompt": "Hello", "max_tokens": 16, "stop": [f"stop {i}" for i in range(10_000)]}).encode()
    r, times = polling_health(server.url, lambda: post(server, "/v1/completions", body))
    refused = error(r, 400)
    assert refused["param"] == "stop" and "--max-stop-strings" in refused["message"]
    assert_health_answered(times)
    too_long = post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 2, "stop": ["x" * 257]})
    assert "--max-stop-length" in error(too_long, 400)["message"]


@pytest.mark.parametrize("depth", [40, 1_000, 100_000])
def test_json_nested_deeper_than_the_limit_is_a_400_never_a_500(server, depth):
    deep = "[" * depth + "]" * depth
    for field in ('"chat_template_kwargs": {"x": %s}', '"tools": [{"x": %s}]', '"response_format": {"type": %s}'):
        raw = ('{"messages": [{"role": "user", "content": "hi"}], ' + field % deep + "}").encode()
        refused = error(post(server, "/v1/chat/completions", raw), 400)
        assert refused["code"] == "json_too_deep" and "--max-json-depth" in refused["message"]
    shallow = post(server, "/v1/chat/completions", chat(chat_template_kwargs={"x": [[["fine"]]]}))
    assert shallow.status_code == 200, shallow.text


def test_a_body_that_is_not_application_json_is_refused_with_415(server):
    body = json.dumps({"prompt": "Hello", "max_tokens": 2}).encode()
    for headers in ({"content-type": "text/plain"}, {"content-type": "application/x-www-form-urlencoded"}, {}):
        assert error(post(server, "/v1/completions", body, headers=headers), 415)["code"] == "unsupported_media_type"
    served = post(server, "/v1/completions", body, headers={"content-type": "application/json; charset=utf-8"})
    assert served.status_code == 200, served.text


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"max_completion_tokens": -3}, "max_completion_tokens"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"n": -2}, "n"),
        ({"max_tokens": None, "max_completion_tokens": 0}, "max_completion_tokens"),
    ],
)
def test_a_zero_or_negative_count_is_refused_not_read_as_unset(server, fields, param):
    assert error(post(server, "/v1/chat/completions", chat(**fields)), 400)["param"] == param


def test_a_batch_of_more_prompts_than_the_queue_holds_is_a_400_naming_the_limit_not_a_429(server):
    refused = error(post(server, "/v1/completions", {"prompt": ["Hello"] * (MAX_WAITING + 1), "max_tokens": 1}), 400)
    assert refused["code"] == "batch_too_large" and "--max-waiting" in refused["message"]
    refused = error(post(server, "/v1/completions", {"prompt": [[1, 2]] * (MAX_WAITING + 1), "max_tokens": 1}), 400)
    assert refused["code"] == "batch_too_large"
    served = post(server, "/v1/completions", {"prompt": ["Hello"] * MAX_WAITING, "max_tokens": 1})
    assert served.status_code == 200 and len(served.json()["choices"]) == MAX_WAITING


def test_a_request_supplied_chat_template_is_refused_and_kwargs_may_not_change_the_call(server):
    template = "{% for i in range(100000) %}{% for j in range(1000) %}{% endfor %}{% endfor %}"
    for body, param in (
        (chat(chat_template_kwargs={"chat_template": template}), "chat_template_kwargs"),
        (chat(chat_template=template), "chat_template"),
    ):
        refused = error(post(server, "/v1/chat/completions", body), 400)
        assert refused["param"] == param and "--trust-request-chat-template" in refused["message"]
    for kwargs in ({"tokenize": True}, {"return_dict": True}, {"tools": []}):
        refused = error(post(server, "/v1/chat/completions", chat(chat_template_kwargs=kwargs)), 400)
        assert refused["param"] == "chat_template_kwargs" and next(iter(kwargs)) in refused["message"]
    served = post(server, "/v1/chat/completions", chat(chat_template_kwargs={"enable_thinking": False}))
    assert served.status_code == 200, served.text


def test_no_cors_headers_are_sent_and_a_foreign_host_header_is_refused(server):
    body = {"prompt": "Hello", "max_tokens": 1}
    r = post(server, "/v1/completions", body, headers={**JSON, "origin": "http://evil.example"})
    assert r.status_code == 200 and not [h for h in r.headers if h.startswith("access-control-")]
    preflight = httpx.options(server.url + "/v1/completions", headers={"origin": "http://evil.example",
                              "access-control-request-method": "POST"})  # fmt: skip
    assert "access-control-allow-origin" not in preflight.headers
    rebound = post(server, "/v1/completions", body, headers={**JSON, "host": f"evil.example:{server.port}"})
    assert error(rebound, 400)["code"] == "invalid_host"
    assert httpx.get(server.url + "/health", headers={"host": "evil.example"}).status_code == 400
    for host in (f"localhost:{server.port}", "127.0.0.1"):
        assert post(server, "/v1/completions", body, headers={**JSON, "host": host}).status_code == 200


def test_every_answer_carries_a_request_id_that_the_log_names_with_a_refusal(server):
    answers = [
        post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 1}),
        post(server, "/v1/completions", {"prompt": "Hello", "max_tokenz": 1}),
        httpx.get(server.url + "/nowhere"),
        httpx.get(server.url + "/health"),
    ]
    ids = [r.headers.get("x-request-id") for r in answers]
    assert [r.status_code for r in answers] == [200, 400, 404, 200] and all(ids) and len(set(ids)) == 4
    assert error(answers[2], 404)["type"] == "not_found_error"
    assert f"request {ids[1]} refused (400)" in server.output()
    mine = post(
        server, "/v1/completions", {"prompt": "Hello", "max_tokens": 1}, headers={**JSON, "x-request-id": "trace-7"}
    )
    assert mine.headers["x-request-id"] == "trace-7"
