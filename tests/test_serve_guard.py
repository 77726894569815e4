"""The server's guard rails without a model: the API key's constant-time compare, 500s that name a
request id and no exception text, the template time budget, and the startup warning for a server
open to the network without a key."""

from __future__ import annotations

import asyncio
import hmac
import logging
import random
import sys
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from starlette.testclient import TestClient

from batchkv.cli import main
from batchkv.serve import access, guard
from batchkv.serve.app import build_app
from batchkv.serve.guard import Access
from batchkv.serve.jobs import ModelInfo
from batchkv.serve.metrics import ServerMetrics
from batchkv.serve.stream import Stream
from batchkv.serve.templates import RenderTimeout, call_with_budget

SECRET = "/home/operator/secret-path: token=abc123"


class FailingWorker:
    """An engine worker whose submits fail with SECRET in the exception (right away, or once streaming)."""

    alive = True
    max_waiting = 8

    def __init__(self, *, mid_stream: bool) -> None:
        self.mid_stream = mid_stream

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        pass

    def stop(self) -> None:
        pass

    def refuse_batch(self, prompts: int) -> None:
        pass

    def post(self, command: tuple) -> None:
        pass

    async def submit(self, requests, arrival: float) -> Stream:
        if not self.mid_stream:
            raise RuntimeError(SECRET)
        stream = Stream(self)
        stream.queue.put_nowait(RuntimeError(SECRET))
        return stream


def client(worker, access: Access | None = None) -> TestClient:
    return TestClient(build_app(worker, ModelInfo("m", None, capacity=64), ServerMetrics(2), access))


def test_a_failure_is_a_500_that_names_the_request_id_and_not_the_exception(caplog):
    body = {"prompt": [1, 2, 3], "max_tokens": 2}
    with caplog.at_level(logging.ERROR, logger="batchkv.serve"), client(FailingWorker(mid_stream=False)) as c:
        r = c.post("/v1/completions", json=body)
    rid = r.headers["x-request-id"]
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert rid in r.json()["error"]["message"] and SECRET not in r.text
    assert any(rid in rec.getMessage() and rec.exc_info and SECRET in str(rec.exc_info[1]) for rec in caplog.records)


def test_a_failure_mid_stream_sends_an_error_event_without_the_exception(caplog):
    body = {"prompt": [1, 2, 3], "max_tokens": 2, "stream": True}
    with caplog.at_level(logging.ERROR, logger="batchkv.serve"), client(FailingWorker(mid_stream=True)) as c:
        r = c.post("/v1/completions", json=body)
    rid = r.headers["x-request-id"]
    assert r.status_code == 200 and SECRET not in r.text and f"request {rid}" in r.text
    assert r.text.endswith("data: [DONE]\n\n")
    assert any(rid in rec.getMessage() and rec.exc_info for rec in caplog.records)


def test_the_api_key_is_compared_with_hmac_compare_digest(monkeypatch):
    seen, compare = [], hmac.compare_digest

    def spy(a, b):
        seen.append((a, b))
        return compare(a, b)

    monkeypatch.setattr(access.hmac, "compare_digest", spy)
    with client(FailingWorker(mid_stream=False), Access(api_key="sk-right")) as c:
        assert c.get("/v1/models", headers={"authorization": "Bearer sk-right"}).status_code == 200
        assert c.get("/v1/models", headers={"authorization": "Bearer sk-wrong"}).status_code == 401
        assert c.get("/v1/models").status_code == 401
    assert seen == [(b"sk-right", b"sk-right"), (b"sk-wrong", b"sk-right"), (b"", b"sk-right")]


def test_a_template_render_past_its_budget_is_interrupted_and_its_thread_ends():
    started = threading.Event()

    def spin() -> None:
        started.set()
        while True:  # Python bytecode: the budget's exception lands here
            pass

    before = {t.ident for t in threading.enumerate()}
    start = time.perf_counter()
    with pytest.raises(RenderTimeout):
        call_with_budget(spin, 0.2)
    assert started.is_set() and 0.2 <= time.perf_counter() - start < 2
    deadline = time.monotonic() + 5
    while {t.ident for t in threading.enumerate()} - before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not {t.ident for t in threading.enumerate()} - before  # the render thread is gone


def test_a_render_that_ends_at_its_budget_neither_leaks_the_interrupt_nor_loses_its_result(monkeypatch):
    failures, outcomes, rng = [], set(), random.Random(0)
    monkeypatch.setattr(threading, "excepthook", failures.append)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(0.0002)  # the waiting thread wakes on time (the server runs at 0.5 ms)
    try:
        for i in range(300):  # renders that finish about when their 2 ms budget runs out
            seconds = 0.0005 + 0.0035 * rng.random()

            def work(i: int = i, seconds: float = seconds) -> int:
                end = time.perf_counter() + seconds
                while time.perf_counter() < end:
                    pass
                return i

            try:
                assert call_with_budget(work, 0.002) == i
                outcomes.add("done")
            except RenderTimeout:
                outcomes.add("timeout")
        time.sleep(0.05)
    finally:
        sys.setswitchinterval(switch)
    assert outcomes == {"done", "timeout"} and failures == []  # no interrupt reached a thread's top level
    assert call_with_budget(lambda: "after", 1.0) == "after"
    with pytest.raises(ZeroDivisionError):
        call_with_budget(lambda: 1 / 0, 1.0)


def test_a_server_on_a_non_loopback_address_without_a_key_warns_at_startup(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("BATCHKV_API_KEY", raising=False)
    serve = ("serve", "--model", str(tmp_path), "--device", "cpu", "--port", "0")
    assert main([*serve, "--host", "0.0.0.0"]) == 2  # the folder has no config.json: it stops after the warning
    assert "warning: listening on 0.0.0.0 (not a loopback address) without an API key" in capsys.readouterr().err
    for argv in (("--host", "0.0.0.0", "--api-key", "sk-x"), ("--host", "127.0.0.1")):
        assert main([*serve, *argv]) == 2
        assert "warning" not in capsys.readouterr().err
    monkeypatch.setenv("BATCHKV_API_KEY", "sk-from-the-environment")
    assert main([*serve, "--host", "0.0.0.0"]) == 2
    assert "warning" not in capsys.readouterr().err
    assert main([*serve, "--api-key", " "]) == 2
    assert "--api-key is empty" in capsys.readouterr().err


def test_the_host_rule_defaults_to_loopback_names_on_a_loopback_address_and_to_any_elsewhere():
    import argparse

    from batchkv.cli.serve import access_from, add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)

    def hosts(bound: str, *argv: str) -> tuple[str, ...] | None:
        return access_from(parser.parse_args(["--model", "m", *argv]), bound).allowed_hosts

    assert set(hosts("127.0.0.1")) == {"localhost", "127.0.0.1", "::1"}
    assert "127.0.0.2" in hosts("127.0.0.2") and "::1" in hosts("::1")
    assert hosts("0.0.0.0") is None and hosts("127.0.0.1", "--allowed-hosts", "*") is None
    assert hosts("0.0.0.0", "--allowed-hosts", "api.example, Other.Example") == ("api.example", "Other.Example")
    refusal = guard.Guard(None, Access(allowed_hosts=("api.example",))).refusal
    assert refusal("GET", "/health", {"host": "API.example:8000"}) is None
    assert refusal("GET", "/health", {"host": "localhost:8000"}).code == "invalid_host"
