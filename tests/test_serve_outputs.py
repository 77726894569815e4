"""The server's choices (`batchkv.serve.outputs.Tracker`) fed scripted engine events: with n = 2,
one sample finishing (length, stop id, stop string) leaves the other to run to its own finish; a
choice that ends by length or stop id while its text ends in part of a stop string releases that
text at the finish, streamed or not, and one whose text released at the finish completes a stop
string ends by "stop". The tokenizer is a table of byte strings, so each token's text is known;
tests/test_serve.py runs the first cases through a real server."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("msgspec")

from batchkv.executor import Event
from batchkv.serve.jobs import Job
from batchkv.serve.outputs import Tracker, completion_body

PIECES = {1: b"ab", 2: b" E", 3: b"N", 4: b"D", 5: b" x", 6: b" y", 7: b"!", 8: b"?", 9: b"\xc3"}  # 9: half of "é"


class Pieces:
    """A byte-level tokenizer whose token i is the bytes PIECES[i] (a broken character decodes as U+FFFD)."""

    def decode(self, ids, **_):
        return b"".join(PIECES[i] for i in ids).decode("utf-8", errors="replace")


class ScriptedStream:
    """A `Stream` that yields the scripted steps (lists of (prompt, event)) and records cancels."""

    def __init__(self, steps: list[list[tuple[int, Event]]]) -> None:
        self.steps, self.cancels, self.read = steps, [], 0
        self.cached: dict[int, int] = {}  # prompt index -> tokens reused (the worker fills it)

    def __aiter__(self):
        return self._items()

    async def _items(self):
        for items in self.steps:
            self.read += 1
            yield items
        raise AssertionError(f"the tracker read past the script's {len(self.steps)} steps")

    def cancel(self, prompt_index: int | None = None) -> None:
        self.cancels.append((self.read, prompt_index))  # (steps read when it was sent, prompt or None: all)


def run(steps, *, n: int = 1, stops=()) -> tuple[Tracker, list, ScriptedStream]:
    """Feed `steps` to a tracker of one prompt; returns it, every delta it yielded, and the stream."""
    job = Job(prompts=[[7]], requests=[], stops=list(stops), n=n, stream=False, include_usage=False, token_ids=True)
    tracker, stream = Tracker(job, Pieces()), ScriptedStream(steps)

    async def collect():
        return [d for deltas in [x async for x in tracker.deltas(stream)] for d in deltas]

    return tracker, asyncio.run(collect()), stream


def tokens(sample: int, *ids: int, finish: str | None = None) -> list[tuple[int, Event]]:
    """Prompt 0's events for `sample`: the ids, the last one carrying `finish`."""
    return [(0, Event(0, t, finish if i == len(ids) - 1 else None, sample)) for i, t in enumerate(ids)]


FIRST_ENDS = {  # how sample 0 ends at its third token while sample 1 decodes on: (its events, reason, text)
    "length": (tokens(0, 5, 6, 7, finish="length"), "length", " x y!"),
    "stop id": (tokens(0, 5, 6, 7, finish="stop"), "stop", " x y"),  # a stop id's text is not output
    "stop string": (tokens(0, 5, 6, 7), "stop", " x"),  # " y" is the stop string: the engine decodes on
}


@pytest.mark.parametrize("how", list(FIRST_ENDS))
def test_one_of_two_samples_finishing_leaves_the_other_to_its_own_finish(how):
    first, reason, text = FIRST_ENDS[how]
    steps = [first[:1] + tokens(1, 8), first[1:2] + tokens(1, 8), first[2:] + tokens(1, 8), tokens(1, 8, 8)]
    steps += [tokens(1, 5, finish="length")]
    if how == "stop string":  # the engine still decodes sample 0; its events after the stop change nothing
        steps[3] += tokens(0, 5)
        steps[4][:0] = tokens(0, 6, finish="length")
    tracker, _, stream = run(steps, n=2, stops=[" y"] if how == "stop string" else ())
    body = completion_body(tracker, "cmpl-x", "m")
    assert [(c["text"], c["finish_reason"]) for c in body["choices"]] == [(text, reason), ("?????" + " x", "length")]
    assert stream.cancels == []  # nothing cancelled: every sample ran to its engine finish


def test_a_sample_finished_by_a_stop_string_is_cancelled_only_once_its_sibling_is_done_too():
    steps = [tokens(0, 5, 6) + tokens(1, 8), tokens(0, 5) + tokens(1, 8, finish="length")]
    tracker, _, stream = run(steps, n=2, stops=[" y"])
    assert [(c.finish, "".join(c.text)) for c in tracker.choices] == [("stop", " x"), ("length", "??")]
    assert stream.cancels[0] == (2, 0)  # with the sibling's finish: the engine still decoded sample 0


HELD = {  # "ab EN" ends in "EN", which could begin the stop string "END"
    "length": (tokens(0, 1, 2, 3, finish="length"), "length"),
    "stop id": (tokens(0, 1, 2, 3, 4, finish="stop"), "stop"),  # the stop id (text "D") is not output
}


@pytest.mark.parametrize("how", list(HELD))
def test_text_held_as_the_start_of_a_stop_string_is_released_at_a_length_or_stop_id_finish(how):
    events, reason = HELD[how]
    tracker, deltas, _ = run([[event] for event in events], stops=["END"])
    streamed = "".join(d.text for d in deltas)
    assert streamed == "ab EN" and "".join(d.text for d in deltas[:-1]) == "ab "  # "EN" held: it may begin "END"
    assert deltas[-1].text == "EN" and deltas[-1].finish == reason  # streamed: released with the finish
    choice = completion_body(tracker, "cmpl-x", "m")["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == ("ab EN", reason)  # not streamed


def test_a_stop_string_completed_by_the_text_released_at_the_finish_ends_the_choice_by_stop():
    # " x" is held (it may begin the stop string); the last token is half a character, held by the
    # detokenizer until the finish, whose U+FFFD completes the stop string
    tracker, deltas, _ = run([tokens(0, 5), tokens(0, 9, finish="length")], stops=[" x\ufffd"])
    assert [(d.text, d.finish) for d in deltas] == [("", None), ("", "stop")]
    assert (tracker.choices[0].finish, "".join(tracker.choices[0].text)) == ("stop", "")
