"""The engine in a process of its own (`batchkv.serve.process`): the same answers as the engine
thread, failures that end the streams and answer 503, startup errors with their own type, and no
engine process left behind. A counting engine in a spawned process first (no model), then
`batchkv serve --engine-process on` over the tiny Qwen3 with the official `openai` client and
transformers' `generate` as the oracle."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import queue
import re
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from batchkv.errors import CapacityError, EngineProcessError
from batchkv.executor import Event, Request, SamplingParams
from batchkv.executor.request import Logprobs
from batchkv.serve.core import EngineCore, decode_events, encode_events, gauges
from batchkv.serve.metrics import ServerMetrics
from batchkv.serve.process import ProcessWorker
from batchkv.serve.protocol import APIError
from batchkv.serve.worker import EngineWorker


class CountingEngine:
    """Token 7 for every live sample each step (`sleep_s` a step), finishing at max_new_tokens;
    a cancel ends the request's samples with "cancelled" events at the next step; the steps whose
    number is in `fail_at` raise."""

    overlap = False
    cached_columns = 0
    kv_usage = (0, 64)
    grammars = None

    def __init__(self, sleep_s: float = 0.0, fail_at: tuple[int, ...] = ()) -> None:
        self.sleep_s, self.fail_at, self.steps = sleep_s, fail_at, 0
        self.left: dict[int, list[int]] = {}  # request id -> tokens still to emit, per sample
        self.cancelled: list[int] = []
        self.next_id = 0
        self.cache = SimpleNamespace(sequences=[])
        self.runner = SimpleNamespace(captures=0)
        self.metrics = SimpleNamespace(step_times=[], inter_token=[], first_token=[])
        self.num_waiting = 0

    has_work = property(lambda self: bool(self.left or self.cancelled))
    num_running = property(lambda self: len(self.left))

    def submit(self, request: Request) -> int:
        self.next_id += 1
        self.left[self.next_id] = [request.params.max_new_tokens] * request.params.n
        return self.next_id

    def cancel(self, rid: int) -> bool:
        if rid in self.left:
            self.cancelled.append(rid)
        return rid in self.left

    def cached_tokens(self, rid: int) -> int | None:
        return 0 if rid in self.left else None

    def step(self) -> list[Event]:
        self.steps += 1
        time.sleep(self.sleep_s)
        if self.steps in self.fail_at:
            raise RuntimeError("a step failed")
        events = []
        for rid in self.cancelled:
            events += [Event(rid, None, "cancelled", s) for s, n in enumerate(self.left.pop(rid, [])) if n > 0]
        self.cancelled = []
        for rid, left in list(self.left.items()):
            for s, n in enumerate(left):
                if n > 0:
                    left[s] -= 1
                    events.append(Event(rid, 7, "length" if n == 1 else None, s))
            if not any(left):
                del self.left[rid]
        return events

    def close(self) -> None:
        pass


def counting(sleep_s: float = 0.0, fail_at: tuple[int, ...] = ()) -> tuple[CountingEngine, str]:
    """The engine process's factory (picklable: this module's function)."""
    return CountingEngine(sleep_s, fail_at), "counting"


def refusing() -> tuple:
    raise CapacityError("the store needs 9 GiB and the device has 1 (lower --max-seqs)")


def exiting() -> tuple:
    os._exit(3)


def unpicklable() -> tuple:
    return CountingEngine(), (lambda: 0)  # a startup answer that cannot cross the pipe


def request(tokens: int, n: int = 1) -> list[Request]:
    return [Request([1, 2], SamplingParams(max_new_tokens=tokens, n=n))]


async def events_of(stream) -> list[tuple[int, Event]]:
    """Every item until each sample finished (bounded by the stream's own finishes)."""
    out: list = []
    async for items in stream:
        out += items
        finishes = sum(event.finish_reason is not None for _, event in out)
        if (
            finishes
            and finishes == sum(1 for _, e in out if e.token is None or e.finish_reason)
            and all(any(e.finish_reason for _, e in out if e.sample == s) for s in {e.sample for _, e in out})
        ):
            return out
    return out


async def launched(factory, **kw) -> ProcessWorker:
    worker = ProcessWorker(factory, max_waiting=8, **kw)
    assert await asyncio.to_thread(worker.launch) == "counting"
    worker.metrics = ServerMetrics(4)
    worker.start(asyncio.get_running_loop())
    return worker


def gone(pid: int) -> bool:
    return not Path(f"/proc/{pid}").exists()


def test_a_steps_events_cross_the_pipe_as_the_engine_made_them():
    lp = Logprobs(5, -0.25, ((5, -0.25), (9, -1.5)))
    made = [Event(3, 11), Event(4, 12, "length", 1, lp), Event(5, None, "cancelled", 0),
            Event(6, 13, None, 0, None, (None, lp))]  # fmt: skip
    assert decode_events(encode_events(made)) == made
    assert all(type(e.logprobs.top) is tuple for e in decode_events(encode_events(made)) if e.logprobs)


def test_the_engine_process_answers_as_the_engine_thread_drains_stops_and_never_outlives_its_pipe():
    async def serve(worker) -> list:
        a = asyncio.ensure_future(events_of(await worker.submit(request(3), time.perf_counter())))
        b = asyncio.ensure_future(events_of(await worker.submit(request(2, n=2), time.perf_counter())))
        return [[(i, e.token, e.finish_reason, e.sample) for i, e in await x] for x in (a, b)]

    async def main() -> tuple[list, list]:
        thread = EngineWorker(CountingEngine(), ServerMetrics(4), max_waiting=8)  # type: ignore[arg-type]
        thread.start(asyncio.get_running_loop())
        try:
            expected = await serve(thread)
        finally:
            await asyncio.to_thread(thread.stop)
        worker = await launched(functools.partial(counting, 0.005))
        pid = worker.process.pid
        try:
            got = await serve(worker)
            long = await worker.submit(request(10_000), time.perf_counter())
            worker.drain(0.2)  # the live request is cancelled at the deadline; new submits are refused
            ended = await asyncio.wait_for(events_of(long), 30)
            assert ended[-1][1].finish_reason == "cancelled"
            with pytest.raises(APIError) as refused:
                await worker.submit(request(1), time.perf_counter())
            assert refused.value.status == 503
            assert worker.alive
        finally:
            await asyncio.to_thread(worker.stop)
        assert not worker.alive and gone(pid)
        orphan = ProcessWorker(counting, max_waiting=8)  # its API process dies: the pipe closes, the engine's ends
        await asyncio.to_thread(orphan.launch)
        orphan._conn.close()
        await asyncio.to_thread(orphan.process.join, 30.0)
        assert orphan.process.exitcode == 0
        return expected, got

    expected, got = asyncio.run(asyncio.wait_for(main(), 120))
    assert got == expected and [len(x) for x in got] == [3, 4]


def test_a_failed_step_fails_its_streams_and_a_killed_engine_process_fails_them_and_answers_503():
    async def main() -> None:
        worker = await launched(functools.partial(counting, 0.01, (2,)))
        pid = worker.process.pid
        try:
            with pytest.raises(EngineProcessError, match="step failed"):
                await events_of(await worker.submit(request(5), time.perf_counter()))
            served = await events_of(await worker.submit(request(2), time.perf_counter()))
            assert [e.token for _, e in served] == [7, 7] and worker.alive  # it serves on
            live = await worker.submit(request(100_000), time.perf_counter())
            async for _ in live:  # a first token: the request is running
                break
            os.kill(pid, signal.SIGKILL)
            with pytest.raises(EngineProcessError):
                await asyncio.wait_for(events_of(live), 30)
            with pytest.raises(APIError) as refused:
                await worker.submit(request(1), time.perf_counter())
            assert refused.value.status == 503 and not worker.alive
        finally:
            await asyncio.to_thread(worker.stop)
        assert gone(pid)

    asyncio.run(asyncio.wait_for(main(), 120))


def test_a_startup_error_in_the_engine_process_is_raised_with_its_type_and_the_process_is_gone():
    worker = ProcessWorker(refusing, max_waiting=8)
    with pytest.raises(CapacityError, match="lower --max-seqs"):
        worker.launch()
    assert not worker.process.is_alive()
    worker.stop()  # after a failed launch: nothing to do, and no error
    dying = ProcessWorker(exiting, max_waiting=8)
    with pytest.raises(EngineProcessError, match="status 3"):
        dying.launch()
    odd = ProcessWorker(unpicklable, max_waiting=8)
    with pytest.raises(EngineProcessError, match="does not pickle"):
        odd.launch()
    odd.process.join(10)
    assert not odd.process.is_alive()


def test_an_idle_engine_core_past_its_drain_deadline_waits_for_commands_instead_of_spinning():
    commands: queue.SimpleQueue = queue.SimpleQueue()
    sent: list = []

    def receive(timeout: float | None):
        try:
            return commands.get(timeout=timeout) if timeout is None or timeout > 0 else commands.get_nowait()
        except queue.Empty:
            return None

    core = EngineCore(CountingEngine(), sent.append, max_waiting=8)
    commands.put(("drain", 0.0))
    thread = threading.Thread(target=core.serve, args=(receive, lambda: not commands.empty()), daemon=True)
    thread.start()
    time.sleep(0.3)
    commands.put(("stop",))
    thread.join(5)
    assert not thread.is_alive()
    assert sum(message[0] == "i" for message in sent) < 10  # it spun: tens of thousands in 0.3 s


def test_a_request_past_its_time_in_the_engine_process_finishes_with_timeout():
    async def main() -> list:
        worker = await launched(functools.partial(counting, 0.01), request_timeout=0.2)
        try:
            stream = await asyncio.wait_for(worker.submit(request(10_000), time.perf_counter()), 30)
            out = await asyncio.wait_for(events_of(stream), 30)
            return [event.finish_reason for _, event in out if event.finish_reason]
        finally:
            await asyncio.to_thread(worker.stop)

    assert asyncio.run(main()) == ["timeout"]


# ---- `batchkv serve --engine-process on` -----------------------------------------------------
def engine_pid(server) -> int:
    """The pid of the server's engine process (its spawned child)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            spawned = b"spawn_main" in (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if ppid == server.proc.pid and spawned:
            return int(entry.name)
    raise AssertionError("the server has no engine process")


def wait_gone(pid: int, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not gone(pid) and time.monotonic() < deadline:  # bounded
        time.sleep(0.05)
    return gone(pid)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.serve_helpers import make_model_dir

    return make_model_dir(tmp_path_factory.mktemp("qwen3-tiny"))


@pytest.fixture(scope="module")
def served(model_dir):
    """`batchkv serve --engine-process on`; stopped by SIGTERM, which must leave no engine process."""
    from tests.serve_helpers import Server

    srv = Server(str(model_dir), "--served-model-name", "tiny", "--engine-process", "on", "--max-seqs", "4",
                 "--capacity", "512", "--max-step-tokens", "64", "--prefill-chunk", "32")  # fmt: skip
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    srv.wait()
    pid = engine_pid(srv)
    yield srv, hf, tokenizer
    code, out = srv.stop(signal.SIGTERM)
    assert code == 0 and "Traceback" not in out, out
    assert "engine process" in out and wait_gone(pid, 5.0)


def test_served_from_an_engine_process_completions_equal_transformers_and_constraints_compile_there(served):
    import torch

    openai = pytest.importorskip("openai")
    jsonschema = pytest.importorskip("jsonschema")
    srv, hf, tokenizer = served
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    prompt = tokenizer.encode("The quick brown fox")
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
                          max_new_tokens=20, do_sample=False, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    ids = out[0, len(prompt) :].tolist()
    text = tokenizer.decode(ids, skip_special_tokens=True)
    whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0,
                                      extra_body={"return_token_ids": True})  # fmt: skip
    assert whole.choices[0].token_ids == ids and whole.choices[0].text == text
    chunks = client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}  # fmt: skip
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello world"}],
                                          max_tokens=40, temperature=0, response_format={"type": "json_schema",
                                          "json_schema": {"name": "a", "schema": schema}})  # fmt: skip
    jsonschema.validate(json.loads(chat.choices[0].message.content), schema)
    with pytest.raises(openai.BadRequestError, match="guided_regex"):  # refused by the compile, in the engine process
        client.completions.create(model="tiny", prompt="x", max_tokens=2, extra_body={"guided_regex": "(("})
    import httpx

    metrics = httpx.get(srv.url + "/metrics").text
    assert re.search(r"^batchkv_generation_tokens_total (\d+)", metrics, re.M).group(1) != "0"


def test_a_killed_engine_process_ends_the_live_stream_with_an_error_and_the_server_answers_503():
    import httpx

    from tests.serve_helpers import Server

    srv = Server("sensenova-u1-tiny", "--engine-process", "on", "--max-seqs", "4").wait()
    try:
        pid = engine_pid(srv)
        body = {"prompt": [1, 2, 3], "max_tokens": 3000, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line).startswith("data: {")  # a first token: it is live
            os.kill(pid, signal.SIGKILL)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and '"error"' in rest[-2]
        health = httpx.get(srv.url + "/health")
        assert health.status_code == 503
        refused = httpx.post(srv.url + "/v1/completions", json={"prompt": [1], "max_tokens": 2})
        assert refused.status_code == 503
    finally:
        code, out = srv.stop(signal.SIGTERM)
    assert code == 0, out
    assert "the engine process exited with status -9" in out


def test_a_startup_error_in_the_engine_process_is_the_clis_one_line_and_exit_status_2(model_dir):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "batchkv.cli", "serve", str(model_dir), "--capacity", "100000",
                           "--engine-process", "on", "--device", "cpu", "--port", "0"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr  # refused in the engine process
    assert "ConfigError: --capacity 100000 is beyond the model's max_position_embeddings" in done.stderr


def test_tokens_of_step_messages_fed_together_each_count_their_inter_token_gap():
    """A reader that fell behind feeds several steps at once; each step is routed at its own time."""
    from batchkv.serve.stream import Route, Stream

    def gaps(metrics: ServerMetrics) -> float:
        return sum(s.value for m in metrics.itl.collect() for s in m.samples if s.name.endswith("_count"))

    worker = ProcessWorker(counting, max_waiting=8)
    loop = asyncio.new_event_loop()
    try:
        worker.metrics, worker._loop = ServerMetrics(4), loop
        worker._routes[1] = Route(Stream(None), 0, 1, 0.0)
        state = gauges(CountingEngine())
        step = [["s", state, [], encode_events([Event(1, 7)]), 10.0 + 0.02 * i] for i in range(3)]
        worker._on_steps(step[:1])
        worker._on_steps(step[1:])  # two steps fed as one: two more gaps, 20 ms each
        assert gaps(worker.metrics) == 2
    finally:
        loop.close()
        worker._conn.close()
        worker._child_conn.close()
