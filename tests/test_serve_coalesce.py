"""The server's per-step output path: the engine thread feeds each stream's `Tracker` (detokenising,
stop strings) and the loop takes merged deltas. A reader that fell behind gets one delta per choice
carrying several tokens, whose text is what the tokens' text would have been one at a time (stop
strings included, even one split over tokens inside the merged chunk); with many streams the worker
wakes at most `WAKES_PER_STEP` of them a step, beside first tokens and finishes; the Rust decode it
uses is the tokenizer's own decode, and its incremental form (the Rust stream) gives the same
pieces; the inter-token latencies a step observes at once count as observed one by one. No timings:
assertions are about text, order and counts."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("msgspec")

from batchkv.executor import Event, Request, SamplingParams
from batchkv.serve import front as front_module
from batchkv.serve.detok import IncrementalDetokenizer, StopStrings, StreamDetokenizer, detokenizers, fast_decoder
from batchkv.serve.jobs import Job
from batchkv.serve.metrics import ServerMetrics, observe_many
from batchkv.serve.outputs import IDLE, PENDING, URGENT, Tracker
from batchkv.serve.worker import EngineWorker

PIECES = {1: b"ab", 2: b" E", 3: b"N", 4: b"D", 5: b" x", 6: b" y", 7: b"!", 9: b"\xc3", 10: b"\xa9"}  # 9+10: "é"


class Pieces:
    """A byte-level tokenizer whose token i is the bytes PIECES[i] (a broken character decodes as U+FFFD)."""

    def decode(self, ids, **_):
        return b"".join(PIECES[i] for i in ids).decode("utf-8", errors="replace")


def job(stops=(), *, stream: bool = True, n: int = 1, tokens: int = 8) -> Job:
    requests = [Request([7], SamplingParams(max_new_tokens=tokens, n=n))]
    return Job(prompts=[[7]], requests=requests, stops=StopStrings(list(stops)), n=n, stream=stream,
               include_usage=False, token_ids=True)  # fmt: skip


def step(token: int, finish: str | None = None, sample: int = 0) -> list[tuple[int, Event]]:
    return [(0, Event(0, token, finish, sample))]


TOKENS = [1, 5, 9, 10, 2, 3, 4, 6, 7]  # "ab x é END y!": "é" split over two tokens, " END" over three


@pytest.mark.parametrize("stops", [(), (" END",), ("N",), ("é E",)])
def test_a_reader_behind_gets_one_delta_whose_text_is_the_text_fed_one_token_at_a_time(stops):
    steps = [step(t) for t in TOKENS[:-1]] + [step(TOKENS[-1], "length")]
    one_by_one, behind = Tracker(job(stops), Pieces()), Tracker(job(stops), Pieces())
    texts, ids = [], []
    for items in steps:
        one_by_one.feed(items, lambda prompt: None)
        for delta in one_by_one.take()[0]:
            texts.append(delta.text)
            ids += delta.token_ids
    for items in steps:  # the reader takes nothing until the end
        behind.feed(items, lambda prompt: None)
    merged, finished = behind.take()
    assert finished and len(merged) == 1
    assert merged[0].text == "".join(texts) and merged[0].token_ids == ids
    assert merged[0].finish == one_by_one.choices[0].finish == ("stop" if stops else "length")
    full = "ab xé END y!"
    assert merged[0].text == (full[: full.index(stops[0])] if stops else full)


def test_a_stop_string_split_over_tokens_inside_a_merged_chunk_cuts_the_text_and_cancels_the_request():
    tracker, cancels = Tracker(job([" END"]), Pieces()), []
    for t in [1, 5, 2, 3, 4, 6]:  # "ab x" " E" "N" "D" " y": the stop completes at "D"; the engine decodes on
        tracker.feed(step(t), cancels.append)
    merged, finished = tracker.take()
    assert finished and [(d.text, d.finish, d.token_ids) for d in merged] == [("ab x", "stop", [1, 5, 2, 3, 4])]
    assert cancels == [0]  # once, when the stop string completed: the engine's later tokens change nothing


def test_a_streamed_answer_wakes_its_reader_for_its_first_tokens_and_its_finish_and_otherwise_waits():
    tracker = Tracker(job(), Pieces())
    assert tracker.feed(step(1), lambda p: None) == URGENT  # the first tokens: time to first token
    assert tracker.wake() is True and tracker.wake() is False  # one wake on its way at a time
    assert tracker.feed(step(5), lambda p: None) == IDLE  # merged into what the coming wake takes
    assert [d.text for d in tracker.take()[0]] == ["ab x"]
    assert tracker.feed(step(6), lambda p: None) == PENDING  # waits for the worker's budget
    assert tracker.feed(step(7, "length"), lambda p: None) == URGENT  # the finish: now
    assert tracker.wake() is True
    assert [(d.text, d.finish) for d in tracker.take()[0]] == [(" y!", "length")]


def test_an_answer_not_streamed_wakes_its_reader_only_once_every_choice_finished():
    tracker = Tracker(job(stream=False, n=2), Pieces())
    assert tracker.feed(step(1) + step(5, sample=1), lambda p: None) == IDLE
    assert tracker.feed(step(6, "length"), lambda p: None) == IDLE  # sample 1 still decodes
    assert tracker.feed(step(7, "length", sample=1), lambda p: None) == URGENT
    assert ["".join(c.text) for c in tracker.choices] == ["ab y", " x!"]


class ScriptEngine:
    """One token per live request per step, from TOKENS, the last one finishing by length. With a
    gate, each step waits until the test releases it (so the test controls when readers run)."""

    overlap = False
    cached_columns = 0
    kv_usage = (0, 64)

    def __init__(self, gated: bool = False, expect: int = 1) -> None:
        self.gate = threading.Semaphore(0) if gated else None
        self.expect = expect  # steps before this many requests arrived emit nothing (and are not gated)
        self.left: dict[int, int] = {}
        self.cache = SimpleNamespace(sequences=[])
        self.runner = SimpleNamespace(captures=0)
        self.metrics = SimpleNamespace(step_times=[], inter_token=[], first_token=[])
        self.num_waiting = 0
        self.steps = 0

    @property
    def has_work(self) -> bool:
        return bool(self.left)

    @property
    def num_running(self) -> int:
        return len(self.left)

    def submit(self, request: Request) -> int:
        rid = 1000 * self.steps + len(self.left)
        self.left[rid] = 0
        return rid

    def cancel(self, rid: int) -> bool:
        return self.left.pop(rid, None) is not None

    def cached_tokens(self, rid: int) -> int | None:
        return 0 if rid in self.left else None

    def step(self) -> list[Event]:
        if self.steps == 0 and len(self.left) < self.expect:
            return []
        if self.gate is not None:
            self.gate.acquire()
        self.steps += 1
        events = []
        for rid in list(self.left):
            i = self.left[rid]
            last = i == len(TOKENS) - 1
            events.append(Event(rid, TOKENS[i], "length" if last else None))
            self.left[rid] = i + 1
            if last:
                del self.left[rid]
        return events


def wait_until(condition, tries: int = 4000) -> None:
    for _ in range(tries):  # bounded: 20 s at most
        if condition():
            return
        time.sleep(0.005)
    raise AssertionError("the condition did not hold in time")


async def read_all(tracker: Tracker, stream) -> list[str]:
    return [d.text for deltas in [x async for x in tracker.deltas(stream)] for d in deltas]


def test_a_reader_that_runs_only_after_the_last_step_gets_the_whole_text_in_two_chunks():
    async def main() -> list[str]:
        engine = ScriptEngine()
        worker = EngineWorker(engine, ServerMetrics(4), max_waiting=8)  # type: ignore[arg-type]
        worker.start(asyncio.get_running_loop())
        try:
            tracker = Tracker(job(), Pieces())
            stream = await worker.submit(tracker.job.requests, 0.0, tracker)
            await asyncio.to_thread(wait_until, lambda: not engine.has_work)  # the reader has not run yet
            return await read_all(tracker, stream)
        finally:
            await asyncio.to_thread(worker.stop)

    texts = asyncio.run(main())
    assert "".join(texts) == "ab xé END y!"
    assert len(texts) <= 2  # the first tokens' wake, then everything else in one (or all in one)


def test_with_more_streams_than_the_budget_each_step_wakes_at_most_the_budget_beside_firsts_and_finishes(
    monkeypatch,
):
    monkeypatch.setattr(front_module, "WAKES_PER_STEP", 1)
    woken: list[int] = []  # streams woken per step

    async def main() -> list[list[str]]:
        engine = ScriptEngine(gated=True, expect=3)
        worker = EngineWorker(engine, ServerMetrics(4), max_waiting=8)  # type: ignore[arg-type]
        dispatch = worker._dispatch

        def counting(deliveries, written=None):
            woken.append(sum(1 for items in deliveries.values() if items == []))
            dispatch(deliveries, written)

        worker._dispatch = counting  # type: ignore[method-assign]
        worker.start(asyncio.get_running_loop())
        try:
            trackers = [Tracker(job(), Pieces()) for _ in range(3)]
            streams = [await worker.submit(t.job.requests, 0.0, t) for t in trackers]
            readers = [asyncio.ensure_future(read_all(t, s)) for t, s in zip(trackers, streams, strict=True)]
            for _ in range(len(TOKENS)):  # one step at a time; every woken reader takes before the next
                engine.gate.release()
                for _ in range(2000):  # bounded: the step and the readers' takes are quick
                    await asyncio.sleep(0.002)
                    if len(woken) == engine.steps and not any(t.woken for t in trackers):
                        break
            return await asyncio.gather(*readers)
        finally:
            await asyncio.to_thread(worker.stop)

    texts = asyncio.run(main())
    assert all("".join(t) == "ab xé END y!" for t in texts)
    assert woken[0] == 3 and woken[-1] == 3  # the first tokens and the finishes of all three, at once
    assert max(woken[1:-1]) <= 1  # in between: the budget


@pytest.fixture(scope="module")
def tokenizer():
    pytest.importorskip("transformers")
    from tests.serve_helpers import make_tokenizer

    return make_tokenizer()


@pytest.mark.parametrize("skip", [True, False])
def test_the_rust_decode_the_server_uses_is_the_tokenizers_own_decode(tokenizer, skip):
    decode = fast_decoder(tokenizer, skip)
    assert decode is not None and fast_decoder(Pieces(), skip) is None
    text = "Café 🙂 <|im_start|>END<|im_end|> über"
    ids = tokenizer.encode(text, add_special_tokens=False)
    options = {"skip_special_tokens": skip, "clean_up_tokenization_spaces": False}
    for i in range(len(ids)):
        for j in range(i + 1, min(i + 4, len(ids)) + 1):
            assert decode(ids[i:j]) == tokenizer.decode(ids[i:j], **options)
    slow = IncrementalDetokenizer(lambda x: tokenizer.decode(x, **options), ids[:2])
    fast = IncrementalDetokenizer(decode, ids[:2])
    assert [fast.add(t) for t in ids[2:]] + [fast.flush()] == [slow.add(t) for t in ids[2:]] + [slow.flush()]


RANDOM_TEXTS = ["naïve 日本語のテキスト 🙂🚀✨ brûlée", "<|im_start|>END<|im_end|> über", "Hello", "Café", ""]


@pytest.mark.parametrize("skip", [True, False])
def test_the_rust_stream_detokenizer_gives_the_incremental_detokenizers_pieces(tokenizer, skip):
    import random

    pytest.importorskip("tokenizers.decoders", minversion=None).DecodeStream  # noqa: B018
    options = {"skip_special_tokens": skip, "clean_up_tokenization_spaces": False}
    decode = lambda ids: tokenizer.decode(ids, **options)  # noqa: E731
    make = detokenizers(tokenizer, skip, decode)
    rng = random.Random(0)
    for case in range(60):  # random ids (broken characters, special tokens) and real text
        prompt = tokenizer.encode(rng.choice(RANDOM_TEXTS), add_special_tokens=False)
        if case % 2:
            ids = tokenizer.encode(rng.choice(RANDOM_TEXTS[:2]), add_special_tokens=False)
        else:
            ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 40))]
        slow, fast = IncrementalDetokenizer(decode, prompt), make(prompt)
        assert isinstance(fast, StreamDetokenizer)
        assert [fast.add(t) for t in ids] + [fast.flush()] == [slow.add(t) for t in ids] + [slow.flush()]


def test_a_stream_detokenizer_whose_rust_stream_fails_goes_on_with_the_two_decode_window(tokenizer):
    class Refuses:
        def __init__(self) -> None:
            self.calls = 0

        def step(self, backend, token):
            self.calls += 1
            if self.calls > 8:  # after the prompt's context and a few tokens
                raise RuntimeError("refused")
            return inner.step(backend, token)

    from tokenizers.decoders import DecodeStream

    inner = DecodeStream(skip_special_tokens=True)
    decode = fast_decoder(tokenizer, True)
    ids = tokenizer.encode(RANDOM_TEXTS[0] * 3, add_special_tokens=False)
    prompt = tokenizer.encode("Hello", add_special_tokens=False)
    fast = StreamDetokenizer(tokenizer.backend_tokenizer, Refuses(), decode, prompt)
    slow = IncrementalDetokenizer(decode, prompt)
    assert "".join([fast.add(t) for t in ids] + [fast.flush()]) == "".join([slow.add(t) for t in ids] + [slow.flush()])
    assert fast.stream is None


def test_inter_token_gaps_observed_at_once_count_as_observed_one_by_one():
    one, many = ServerMetrics(4), ServerMetrics(4)
    gaps = [(2**-10, 3), (3 * 2**-10, 5), (0.015625, 1), (0.25, 4), (7.5, 2)]  # dyadic (exact sums); a bound; past all
    for gap, count in gaps:
        for _ in range(count):
            one.itl.observe(gap)
        observe_many(many.itl, gap, count)

    def series(metrics):
        return [line for line in metrics.exposition().decode().splitlines() if "inter_token" in line]

    assert series(many) == series(one) and any("_count 15.0" in line for line in series(one))
