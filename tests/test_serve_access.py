"""`batchkv serve` with its access and trust options set: an API key (from BATCHKV_API_KEY), a
request time limit, trusted request templates under a time budget, 10,000 stop strings allowed,
one CORS origin. A real server over a tiny transformers Qwen3, driven by `httpx` and `openai`."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
transformers = pytest.importorskip("transformers")

from tests.serve_helpers import Server, assert_health_answered, error, make_model_dir, polling_health  # noqa: E402

KEY = "sk-batchkv-test-0123456789"
AUTH = {"authorization": f"Bearer {KEY}", "content-type": "application/json"}
TIMEOUT_S = 3.0
CAPACITY = 8192  # a request for all of it takes far longer than TIMEOUT_S, even on a fast CPU
ORIGIN = "http://app.example"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("qwen3-tiny"), max_positions=CAPACITY)


@pytest.fixture(scope="module")
def server(model_dir):
    srv = Server(
        str(model_dir),
        "--capacity", str(CAPACITY),
        "--max-seqs", "2",
        "--request-timeout", str(TIMEOUT_S),
        "--trust-request-chat-template",
        "--chat-template-timeout", "0.5",
        "--max-stop-strings", "10000",
        "--allowed-origins", ORIGIN,
        env={"BATCHKV_API_KEY": KEY},
    )  # fmt: skip
    yield srv.wait()
    code, out = srv.stop(signal.SIGTERM)
    assert code == 0, out
    assert KEY not in out  # the key is never printed


def post(server, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(server.url + path, content=json.dumps(body).encode(), headers=headers or AUTH, timeout=120)


def metrics(server) -> dict[str, float]:
    lines = httpx.get(server.url + "/metrics", headers=AUTH).text.splitlines()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines if line and line[0] != "#"}


def test_without_the_api_key_every_route_but_health_answers_401(server):
    body = {"prompt": "Hello", "max_tokens": 2}
    counted = 'batchkv_requests_refused_total{status="401"}'
    before = metrics(server).get(counted, 0.0)
    for headers in ({"content-type": "application/json"}, {**AUTH, "authorization": "Bearer sk-wrong"},
                    {**AUTH, "authorization": KEY}):  # fmt: skip
        refused = error(post(server, "/v1/completions", body, headers), 401)
        assert refused["code"] == "invalid_api_key" and KEY not in refused["message"]
    assert error(httpx.get(server.url + "/v1/models"), 401)["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/metrics").status_code == 401
    assert metrics(server)[counted] == before + 5
    assert httpx.get(server.url + "/metrics", headers=AUTH).status_code == 200
    assert httpx.get(server.url + "/health").status_code == 200
    assert post(server, "/v1/completions", body).status_code == 200
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    assert client.completions.create(model=client.models.list().data[0].id, prompt="Hello", max_tokens=2).choices
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="sk-wrong", max_retries=0).models.list()


def test_a_request_past_the_time_limit_ends_with_finish_reason_timeout_and_frees_its_columns(server):
    long = {"prompt": [5, 6, 7], "max_tokens": CAPACITY - 3, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}  # fmt: skip
    timed_out = 'batchkv_request_samples_finished_total{reason="timeout"}'
    before = metrics(server).get(timed_out, 0.0)

    async def timed(client: httpx.AsyncClient) -> tuple[httpx.Response, float]:
        start = time.perf_counter()
        r = await client.post(server.url + "/v1/completions", content=json.dumps(long))
        return r, time.perf_counter() - start

    async def run() -> list[tuple[httpx.Response, float]]:
        async with httpx.AsyncClient(timeout=60, headers=AUTH) as client:
            return await asyncio.gather(*(timed(client) for _ in range(3)))  # three requests, two columns

    answers = asyncio.run(run())
    choices = [r.json()["choices"][0] for r, _ in answers]
    assert [c["finish_reason"] for c in choices] == ["timeout"] * 3
    assert max(len(c["token_ids"]) for c in choices) < CAPACITY - 3
    # One of them waited for a column until the other two timed out: its time runs from its arrival,
    # so it ends with them, not a whole TIMEOUT_S after it got a column.
    assert all(TIMEOUT_S <= seconds < 2 * TIMEOUT_S for _, seconds in answers), answers
    with httpx.stream("POST", server.url + "/v1/completions", json={**long, "stream": True}, headers=AUTH) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert events[-1]["choices"][0]["finish_reason"] == "timeout"
    deadline = time.monotonic() + 10
    while metrics(server)["batchkv_kv_columns_in_use"] and time.monotonic() < deadline:
        time.sleep(0.05)
    m = metrics(server)
    assert m["batchkv_kv_columns_in_use"] == m["batchkv_requests_running"] == m["batchkv_requests_waiting"] == 0
    assert m[timed_out] == before + 4


def test_a_trusted_request_template_renders_sandboxed_and_within_its_time_budget(server, model_dir):
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "user", "content": "Hello world"}]
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    rendered = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False)
    body = {"messages": messages, "max_tokens": 1, "chat_template": template, "return_token_ids": True}
    served = post(server, "/v1/chat/completions", body)
    assert served.json()["prompt_token_ids"] == tokenizer.encode(rendered, add_special_tokens=False)
    escape = {**body, "chat_template": "{{ ''.__class__.__mro__[1].__subclasses__() }}"}
    assert "unsafe" in error(post(server, "/v1/chat/completions", escape), 400)["message"]
    slow = {**body, "chat_template": "{% for i in range(100000) %}{% for j in range(1000) %}{% endfor %}{% endfor %}"}
    start = time.perf_counter()
    r, times = polling_health(server.url, lambda: post(server, "/v1/chat/completions", slow))
    assert error(r, 400)["code"] == "template_timeout" and time.perf_counter() - start < 5
    assert_health_answered(times)
    assert post(server, "/v1/chat/completions", body).status_code == 200  # the server serves on


def test_10000_stop_strings_are_matched_without_stalling_the_server(server):
    prompt = {"prompt": "The quick brown fox", "max_tokens": 40, "temperature": 0}
    text = post(server, "/v1/completions", prompt).json()["choices"][0]["text"]
    stop = next(text[i : i + 3] for i in range(8, len(text) - 3) if "\ufffd" not in text[i : i + 3])
    decoys = [f"\x01decoy {i}" for i in range(9_999)]  # never generated: the text is decoded from the vocabulary
    body = json.dumps({**prompt, "stop": [*decoys[:5000], stop, *decoys[5000:]]}).encode()

    def send() -> httpx.Response:
        return httpx.post(server.url + "/v1/completions", content=body, headers=AUTH, timeout=120)

    r, times = polling_health(server.url, send)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == text[: text.index(stop)] and choice["finish_reason"] == "stop"
    assert_health_answered(times)


def test_cors_headers_go_to_the_allowed_origin_only_and_preflights_need_no_key(server):
    allowed = httpx.get(server.url + "/v1/models", headers={**AUTH, "origin": ORIGIN})
    assert allowed.headers["access-control-allow-origin"] == ORIGIN
    assert "x-request-id" in allowed.headers["access-control-expose-headers"]
    other = httpx.get(server.url + "/v1/models", headers={**AUTH, "origin": "http://evil.example"})
    assert "access-control-allow-origin" not in other.headers
    ask = {"origin": ORIGIN, "access-control-request-method": "POST",
           "access-control-request-headers": "authorization, content-type"}  # fmt: skip
    preflight = httpx.options(server.url + "/v1/chat/completions", headers=ask)
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == ORIGIN
    refused = httpx.options(server.url + "/v1/chat/completions", headers={**ask, "origin": "http://evil.example"})
    assert "access-control-allow-origin" not in refused.headers
