"""`batchkv serve` as a client sees it: a real server on 127.0.0.1 over a tiny transformers Qwen3
(random weights, a tokenizer trained here), driven by the official `openai` client and by `httpx`,
with transformers' own `generate` as the oracle. One server process serves most tests."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
import time

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
transformers = pytest.importorskip("transformers")

from tests.serve_helpers import Server, make_model_dir  # noqa: E402

CAPACITY = 512
MAX_SEQS = 4
MAX_WAITING = 16
PROMPTS = [
    "Hello world",
    "The quick brown fox",
    "Café crème",
    "日本語の",
    "Emoji 🙂",
    "Stop strings may",
    "How are you",
    "lazy dog.",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("qwen3-tiny"))


@pytest.fixture(scope="module")
def booting(model_dir):
    """The shared server, started; it boots while the oracle loads (see `server`)."""
    srv = Server(
        str(model_dir),
        "--served-model-name", "tiny",
        "--max-seqs", str(MAX_SEQS),
        "--capacity", str(CAPACITY),
        "--max-step-tokens", "64",
        "--prefill-chunk", "32",
        "--max-waiting", str(MAX_WAITING),
    )  # fmt: skip
    yield srv
    code, out = srv.stop(signal.SIGTERM)
    assert code == 0, out


@pytest.fixture(scope="module")
def hf(model_dir, booting):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    return model, tokenizer


@pytest.fixture(scope="module")
def server(booting, hf):
    return booting.wait()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def oracle(hf, prompt_ids: list[int], max_new: int) -> tuple[list[int], str]:
    """transformers' greedy generate (it stops at the eos id, as the server does): ids and text."""
    model, tokenizer = hf
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.int64),
            max_new_tokens=max_new,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
        )
    ids = out[0, len(prompt_ids) :].tolist()
    return ids, tokenizer.decode(ids, skip_special_tokens=True)


def metrics(server) -> dict[str, float]:
    """/metrics as {series: value} (labels included in the series name)."""
    lines = httpx.get(server.url + "/metrics").text.splitlines()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines if line and line[0] != "#"}


def wait_idle(server, timeout: float = 10.0) -> dict[str, float]:
    """Poll /metrics until no request runs or waits and no column is held."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        idle = m["batchkv_requests_running"] == m["batchkv_requests_waiting"] == m["batchkv_kv_columns_in_use"] == 0
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def sse(lines) -> list[dict]:
    """The JSON events of a server-sent-event stream; asserts it ends with [DONE]."""
    events = [line[len("data: ") :] for line in lines if line]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


# ---- outputs against transformers ------------------------------------------------------------
def test_completion_greedy_equals_transformers_generate(server, client, hf):
    tokenizer = hf[1]
    for prompt in PROMPTS[:3]:
        ids, text = oracle(hf, tokenizer.encode(prompt), 24)
        out = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=24, temperature=0, extra_body={"return_token_ids": True}
        )
        choice = out.choices[0]
        assert choice.token_ids == ids and choice.text == text
        assert choice.finish_reason == ("stop" if len(ids) < 24 else "length")
        assert out.usage.prompt_tokens == len(tokenizer.encode(prompt)) and out.usage.completion_tokens == len(ids)


def test_completion_of_token_ids_streamed_equals_transformers_generate(server, hf):
    prompt = hf[1].encode("Emoji 🙂 are multi-byte")
    ids, text = oracle(hf, prompt, 30)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 30, "temperature": 0, "stream": True,
            "return_token_ids": True, "stream_options": {"include_usage": True}}  # fmt: skip
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse(r.iter_lines())
    chunks, usage = events[:-1], events[-1]["usage"]
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == ids
    assert "".join(c["choices"][0]["text"] for c in chunks) == text
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert usage["prompt_tokens_details"]["cached_tokens"] < len(prompt)  # the last prompt token is computed
    assert {k: v for k, v in usage.items() if k != "prompt_tokens_details"} == {
        "prompt_tokens": len(prompt),
        "completion_tokens": len(ids),
        "total_tokens": len(prompt) + len(ids),
    }


def test_chat_greedy_streamed_and_not_equals_transformers_generate_over_the_chat_template(server, client, hf):
    tokenizer = hf[1]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello world"}]
    prompt = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
    ids, text = oracle(hf, prompt, 20)
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=0)
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content == text
    assert out.usage.prompt_tokens == len(prompt) and out.usage.completion_tokens == len(ids)
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert chunks[-1].choices[0].finish_reason == out.choices[0].finish_reason


def test_n_2_gives_two_choices_greedy_equal_and_seeded_sampling_reproducible(server, client, hf):
    ids, text = oracle(hf, hf[1].encode("Hello world"), 12)
    out = client.completions.create(model="tiny", prompt="Hello world", max_tokens=12, temperature=0, n=2)
    assert [c.index for c in out.choices] == [0, 1] and [c.text for c in out.choices] == [text, text]
    assert out.usage.completion_tokens == 2 * len(ids)
    sampled = [
        client.completions.create(model="tiny", prompt="Hello", max_tokens=16, temperature=1.0, n=2, seed=7)
        for _ in range(2)
    ]
    assert [c.text for c in sampled[0].choices] == [c.text for c in sampled[1].choices]
    assert sampled[0].choices[0].text != sampled[0].choices[1].text  # two samples, not one twice


def _stop_case(hf) -> tuple[list[int], str, str]:
    """A prompt whose greedy text has a clean stretch; a stop string that spans a token boundary."""
    tokenizer = hf[1]
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    for prompt in PROMPTS:
        ids, text = oracle(hf, tokenizer.encode(prompt), 40)
        for k in range(4, len(ids) - 2):
            head = decode(ids[:k])
            cut = len(head)
            stop = text[cut - 2 : cut + 2]
            if text.startswith(head) and len(stop) == 4 and "\ufffd" not in stop and not stop.isspace():
                return tokenizer.encode(prompt), text, stop
    raise AssertionError("no prompt gave a clean greedy stretch")


def test_a_stop_string_spanning_tokens_ends_the_text_before_it_streamed_and_not(server, client, hf):
    prompt, text, stop = _stop_case(hf)
    expected = text[: text.index(stop)]
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=40, temperature=0, stop=[stop, "\x00"])
    assert out.choices[0].text == expected and out.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=40, temperature=0, stop=stop,
                                            stream=True))  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert wait_idle(server)["batchkv_kv_columns_in_use"] == 0  # the stopped sample's column is free


def _finished(server) -> dict[str, float]:
    prefix = "batchkv_request_samples_finished_total{reason="
    return {k[len(prefix) + 1 : -2]: v for k, v in wait_idle(server).items() if k.startswith(prefix)}


def test_metrics_count_each_finish_reason_as_the_client_sees_it(server, client, hf):
    prompt, _, stop = _stop_case(hf)
    before = _finished(server)
    reasons = [client.completions.create(model="tiny", prompt=prompt, max_tokens=40, temperature=0, stop=stop)
               .choices[0].finish_reason]  # fmt: skip
    reasons += [c.finish_reason for c in client.completions.create(model="tiny", prompt=prompt, max_tokens=3,
                                                                    temperature=0, n=2).choices]  # fmt: skip
    assert reasons == ["stop", "length", "length"]
    after = _finished(server)
    grown = {reason: after[reason] - before.get(reason, 0.0) for reason in after}
    assert {reason: n for reason, n in grown.items() if n} == {"stop": 1, "length": 2}


def test_stop_token_ids_end_a_choice_at_that_token_whose_text_is_not_output(server, client, hf):
    tokenizer = hf[1]
    ids, _ = oracle(hf, tokenizer.encode("How are you"), 20)
    # An ordinary (not special) token with text of its own, first seen at k: vLLM drops a stop id's text.
    k = next(k for k in range(3, 20) if ids[k] not in ids[:k] and tokenizer.decode([ids[k]]).strip())
    out = client.completions.create(model="tiny", prompt="How are you", max_tokens=20, temperature=0,
                                    extra_body={"stop_token_ids": [ids[k]], "return_token_ids": True})  # fmt: skip
    assert out.choices[0].token_ids == ids[: k + 1] and out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == tokenizer.decode(ids[:k], skip_special_tokens=True)


def test_text_held_as_the_start_of_a_stop_string_is_released_at_a_length_or_stop_id_finish(server, client, hf):
    tokenizer = hf[1]
    ids, _ = oracle(hf, tokenizer.encode("How are you"), 20)
    texts = [tokenizer.decode(ids[:k], skip_special_tokens=True) for k in range(20)]
    # a stop id first seen at k, after text ending in two whole characters (no space, no U+FFFD)
    k = next(k for k in range(3, 20) if ids[k] not in ids[:k] and len(texts[k][-2:].strip().strip("\ufffd")) == 2)
    text = texts[k]
    stop = text[-2:] + "\x00"  # the text's last two characters begin it, so they are held until the finish
    client = client.with_options(timeout=60)
    for reason, extra in (("length", {"max_tokens": k}), ("stop", {"max_tokens": 20, "stop_token_ids": [ids[k]]})):
        args = dict(model="tiny", prompt="How are you", temperature=0, stop=[stop], extra_body=extra)
        out = client.completions.create(**args)
        assert (out.choices[0].text, out.choices[0].finish_reason) == (text, reason)
        chunks = list(client.completions.create(**args, stream=True))
        assert "".join(c.choices[0].text for c in chunks) == text and chunks[-1].choices[0].finish_reason == reason


def test_one_of_two_samples_finishing_leaves_the_other_to_its_own_finish(server, client, hf):
    args = dict(model="tiny", prompt="Hello", max_tokens=16, temperature=1.0, n=2, seed=7)
    client = client.with_options(timeout=60)
    free = client.completions.create(**args, extra_body={"return_token_ids": True}).choices
    first, second = free[0].token_ids, free[1].token_ids
    k = next(k for k in range(1, len(first) - 1) if first[k] not in first[:k] + second)
    stopped = client.completions.create(**args, extra_body={"return_token_ids": True, "stop_token_ids": [first[k]]})
    assert (stopped.choices[0].token_ids, stopped.choices[0].finish_reason) == (first[: k + 1], "stop")
    other = stopped.choices[1]  # decodes on alone after the stop (its draws need not repeat the free run's)
    assert other.token_ids[: k + 1] == second[: k + 1] and len(other.token_ids) > k + 1
    assert other.finish_reason == "stop" or (other.finish_reason == "length" and len(other.token_ids) == 16)
    # a stop string only the first sample's text holds: the engine decodes both on, as in the free run
    text, other_text = free[0].text, free[1].text
    stop = next(text[i : i + 3] for i in range(1, len(text) - 3) if text[i : i + 3] not in text[:i] + other_text)
    cut = client.completions.create(**args, stop=[stop])
    assert [(c.text, c.finish_reason) for c in cut.choices] == [
        (text[: text.index(stop)], "stop"),
        (other_text, free[1].finish_reason),
    ]
    assert wait_idle(server)["batchkv_kv_columns_in_use"] == 0


def test_sixteen_concurrent_streams_each_equal_their_own_generate(server, hf):
    tokenizer = hf[1]
    cases = [(PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)), 8 + 3 * i) for i in range(16)]
    expected = [oracle(hf, tokenizer.encode(p), m) for p, m in cases]

    async def one(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> tuple[list[int], str]:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "return_token_ids": True}  # fmt: skip
        async with client.stream("POST", server.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            events = sse([line async for line in r.aiter_lines()])
        return [t for e in events for t in e["choices"][0]["token_ids"]], "".join(
            e["choices"][0]["text"] for e in events
        )

    async def run() -> list:
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(one(client, p, m) for p, m in cases))

    assert asyncio.run(run()) == expected
    m = wait_idle(server)
    assert m["batchkv_requests_running"] == 0 and m["batchkv_kv_columns_in_use"] == 0


# ---- disconnects and the queue -----------------------------------------------------------------
def _cancelled(server) -> float:
    return metrics(server).get('batchkv_request_samples_finished_total{reason="abort"}', 0.0)


def test_a_client_that_disconnects_mid_stream_cancels_its_request(server):
    before = _cancelled(server)
    body = {"prompt": [5, 6, 7], "max_tokens": 400, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        assert metrics(server)["batchkv_kv_columns_in_use"] == 1
    m = wait_idle(server)
    assert m["batchkv_requests_running"] == 0 and m["batchkv_kv_columns_in_use"] == 0
    assert _cancelled(server) == before + 1


def test_a_client_that_gives_up_on_a_plain_request_cancels_it(server):
    before = _cancelled(server)
    body = {"prompt": [5, 6, 7], "max_tokens": 500, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=0.5)
    m = wait_idle(server)
    assert m["batchkv_requests_running"] == 0 and m["batchkv_kv_columns_in_use"] == 0
    assert _cancelled(server) == before + 1


def test_more_requests_than_the_queue_holds_get_429_and_the_rest_are_served(server):
    long = {"prompt": [9, 9, 9], "max_tokens": CAPACITY - 3, "temperature": 0, "stream": True, "ignore_eos": True}
    with contextlib.ExitStack() as stack:
        client = stack.enter_context(httpx.Client(timeout=30))
        first = stack.enter_context(client.stream("POST", server.url + "/v1/completions", json=long))
        lines = first.iter_lines()  # keep it: a dropped line iterator closes the stream (a disconnect)
        assert next(lines).startswith("data: ")  # running: holds one column
        # n = max_seqs cannot be admitted while a column is held, and nothing jumps the queue behind it.
        wide = {**long, "max_tokens": 4, "n": MAX_SEQS}
        queued = [stack.enter_context(client.stream("POST", server.url + "/v1/completions", json=wide))]
        short = {**long, "max_tokens": 4}
        queued += [stack.enter_context(client.stream("POST", server.url + "/v1/completions", json=short))
                   for _ in range(MAX_WAITING - 1)]  # fmt: skip
        assert all(r.status_code == 200 for r in queued)
        assert metrics(server)["batchkv_requests_waiting"] == MAX_WAITING
        refused = client.post(server.url + "/v1/completions", json={"prompt": [1], "max_tokens": 2})
        assert refused.status_code == 429
        assert (
            refused.json()["error"]["code"] == "queue_full" and str(MAX_WAITING) in refused.json()["error"]["message"]
        )
    m = wait_idle(server)
    assert m["batchkv_requests_running"] == m["batchkv_kv_columns_in_use"] == 0
    assert client_still_serves(server)


# ---- refusals ----------------------------------------------------------------------------------
def client_still_serves(server) -> bool:
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "temperature": 0})
    return r.status_code == 200 and len(r.json()["choices"]) == 1


BAD = [
    ("malformed JSON", b'{"prompt": "x", ', 400, None),
    ("unknown field", {"prompt": "x", "max_tokenz": 3}, 400, "max_tokenz"),
    ("wrong type", {"prompt": "x", "max_tokens": "three"}, 400, "max_tokens"),
    ("beyond capacity", {"prompt": "Hello", "max_tokens": CAPACITY}, 400, "max_tokens"),
    ("token id outside the vocabulary", {"prompt": [1, 2, 100000], "max_tokens": 3}, 400, "prompt"),
    ("token id 2**63", {"prompt": [1, 2**63], "max_tokens": 3}, 400, "prompt"),
    ("token id 2**64 in a batch", {"prompt": [[1], [2**64]], "max_tokens": 3}, 400, "prompt"),
    ("a stop token id past int64", {"prompt": [1], "max_tokens": 3, "stop_token_ids": [2**63]}, 400, "stop_token_ids"),
    ("unknown model", {"model": "gpt-5", "prompt": "x", "max_tokens": 3}, 404, "model"),
    ("unsupported field", {"prompt": "x", "suffix": "end"}, 400, "suffix"),
    ("n beyond the columns", {"prompt": "x", "max_tokens": 3, "n": MAX_SEQS + 1}, 400, "n"),
    ("n 0", {"prompt": "x", "max_tokens": 3, "n": 0}, 400, "n"),
    ("mixed prompt batch", {"prompt": ["x", [1, 2]], "max_tokens": 3}, 400, "prompt"),
    ("top_p out of range", {"prompt": "x", "max_tokens": 3, "top_p": 1.5}, 400, "top_p"),
    ("max_tokens 0", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("a negative token id", {"prompt": [1, -2], "max_tokens": 3}, 400, "prompt"),
    ("logprobs past 5", {"prompt": "x", "max_tokens": 3, "logprobs": 6}, 400, "logprobs"),
    ("logprobs as a bool", {"prompt": "x", "max_tokens": 3, "logprobs": True}, 400, "logprobs"),
    ("priority past int32", {"prompt": "x", "max_tokens": 3, "priority": 2**31}, 400, "priority"),
]


@pytest.mark.parametrize(("case", "body", "status", "param"), BAD, ids=[b[0] for b in BAD])
def test_a_bad_request_gets_an_openai_error_and_the_server_keeps_serving(server, case, body, status, param):
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(server.url + "/v1/completions", headers={"content-type": "application/json"}, **kwargs)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"] and error["param"] == param
    if case == "beyond capacity":
        assert str(CAPACITY) in error["message"] and error["code"] == "context_length_exceeded"
    if case.startswith("token id"):
        assert str(body["prompt"][-1]).strip("[]") in error["message"], error  # the id itself is named
    if case.startswith("n "):  # one bound, said the same way below and above it
        assert (
            error["message"] == f"n is {body['n']}; this server takes n in [1, {MAX_SEQS}] (the server's --max-n, "
            "at most its --max-seqs)"
        )
    if case == "unknown field":
        assert error["message"] == "this server does not accept the field 'max_tokenz' (remove it)"
    assert client_still_serves(server)


def test_the_openai_client_raises_its_typed_errors(server, client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match=str(CAPACITY)):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=10**6)


def test_models_health_and_metrics(server):
    models = httpx.get(server.url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny"] and models["data"][0]["max_model_len"] == CAPACITY
    assert httpx.get(server.url + "/health").status_code == 200
    m = metrics(server)
    for name in ("batchkv_generation_tokens_total", "batchkv_prompt_tokens_total", "batchkv_graph_captures_total",
                 "batchkv_time_to_first_token_seconds_count", "batchkv_inter_token_latency_seconds_count",
                 "batchkv_kv_columns_total"):  # fmt: skip
        assert name in m, name
    assert m["batchkv_kv_columns_total"] == MAX_SEQS


def test_a_repeated_prompt_reports_the_tokens_it_reused_in_usage_and_metrics(server, client):
    prompt = "The same long preamble, sent twice, is computed once and then reused: " * 3
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0)
    before = metrics(server)["batchkv_prompt_tokens_cached_total"]
    second = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0)
    assert second.choices[0].text == first.choices[0].text
    n = second.usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens == n - 1  # all but the last prompt token
    assert metrics(server)["batchkv_prompt_tokens_cached_total"] - before == n - 1
    assert wait_idle(server)["batchkv_kv_columns_cached"] >= 1  # the histories stay, freed when needed


# ---- a preset, and shutdown --------------------------------------------------------------------
def test_a_preset_serves_token_ids_as_the_engine_does_refuses_text_and_shuts_down_cleanly():
    from batchkv.executor import MAX_SAMPLE_ROWS, Engine, Request, SamplingParams, gather
    from batchkv.models import build_model

    # One server speculates (n-gram drafts: lossless, so the plain engine's tokens); the other stores e4m3
    # K/V in a store sized to this machine's memory, overlaps planning with the forward and caps prefill.
    draining = Server("sensenova-u1-tiny", "--max-seqs", "2", "--capacity", "2048", "--speculative", "ngram",
                      "--spec-block", "4")  # fmt: skip
    cutting = Server("sensenova-u1-tiny", "--max-seqs", "auto", "--capacity", "2048", "--drain-timeout", "0.3",
                     "--kv-dtype", "fp8", "--overlap", "on", "--prefill-budget", "3")  # fmt: skip
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    expected = {}
    for kv_dtype, options in ((None, {}), (torch.float8_e4m3fn, {"overlap": True, "prefill_budget": 3})):
        model = build_model("sensenova-u1-tiny", "cpu", seed=0)
        engine = Engine(model, max_seqs=2, capacity=64, kv_dtype=kv_dtype, **options)
        rid = engine.submit(Request(prompt, SamplingParams(max_new_tokens=10)))
        expected[kv_dtype] = gather(engine.run_until_done())[rid].tokens[0]
    try:
        url = draining.wait().url + "/v1/completions"
        r = httpx.post(url, json={"prompt": prompt, "max_tokens": 10, "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == expected[None]
        r = httpx.post(
            cutting.wait().url + "/v1/completions", json={"prompt": prompt, "max_tokens": 10, "temperature": 0}
        )
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == expected[torch.float8_e4m3fn]
        sized = re.search(r"sized the store: a pool of (\d+) positions for at most (\d+) sequences", cutting.output())
        # auto: as many sequences as one step decodes (MAX_SAMPLE_ROWS, within the 1,024-token step)
        assert sized and int(sized[1]) >= 2048 and metrics(cutting)["batchkv_kv_columns_total"] == int(sized[2])
        assert int(sized[2]) == MAX_SAMPLE_ROWS == 1024
        r = httpx.post(url, json={"prompt": "text", "max_tokens": 3})
        assert r.status_code == 400 and "tokenizer" in r.json()["error"]["message"]
        # SIGTERM with a request in flight: it finishes, then the server exits 0.
        with httpx.stream("POST", url, json={"prompt": prompt, "max_tokens": 40, "stream": True}) as r:
            lines = r.iter_lines()
            first = next(lines)
            draining.proc.send_signal(signal.SIGTERM)
            events = sse([first, *lines])
        assert sum(len(e["choices"][0]["token_ids"]) for e in events) == 40
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        # SIGINT with a long request in flight: cancelled once the drain timeout passes, exit 0.
        body = {"prompt": prompt, "max_tokens": 2000, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", cutting.wait().url + "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            first = next(lines)
            cutting.proc.send_signal(signal.SIGINT)
            events = sse([first, *lines])
        assert events[-1]["choices"][0]["finish_reason"] == "abort"
        assert sum(len(e["choices"][0]["token_ids"]) for e in events) < 2000
    finally:
        results = [draining.stop(None), cutting.stop(None)]
    for code, out in results:
        assert code == 0, out
        assert "Traceback" not in out, out
    assert "speculative ngram (block 4)" in results[0][1]
    assert f"max_seqs {sized[2]}, capacity 2048, kv fp8, prefill budget 3" in results[1][1]
    assert "(eager, overlap)" in results[1][1]


def test_the_readmes_openai_client_example_runs_against_the_server(server, capsys):
    from pathlib import Path

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    example = re.search(r"official `openai` client:\n\n```py\n(.*?)```", readme, flags=re.S).group(1)
    example = example.replace("http://127.0.0.1:8000", server.url).replace("/models/Qwen3-0.6B", "tiny")
    exec(compile(example, "README.md[openai]", "exec"), {})
    assert capsys.readouterr().out.strip()
