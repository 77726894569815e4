"""Tool calls: the output parsers (Hermes, Llama 3 JSON, Mistral, and the constrained forms), and a
round trip through `batchkv serve` with the official `openai` client over a tiny Qwen3 whose chat
template has Hermes-style tools support: tools -> tool_calls parsed (auto, required, named; streamed
and not) -> a tool message -> a final answer; streamed calls as index/id/name then argument
fragments, incremental over the text, equal to the whole answer's calls (the parser fed piece by
piece, and the `openai` client's stream helpers)."""

from __future__ import annotations

import json
import signal

import pytest

from batchkv.serve.protocol import APIError
from batchkv.serve.tool_stream import ToolStream
from batchkv.serve.tools import ToolPlan, parse, plan

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1,
                                                                        "maximum": 7}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}  # fmt: skip
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call functions:\n<tools>{% for t in tools %}{{ t | tojson }}"
    '{% endfor %}</tools>\nReply with <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\n'
    "{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n{% for c in m.tool_calls %}"
    "<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>{{ m.content }}</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def auto(parser: str) -> ToolPlan:
    return ToolPlan([WEATHER], "auto", parser)


def test_the_parsers_read_each_template_familys_calls_and_leave_plain_text_alone():
    hermes = (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
    )
    content, calls = parse(hermes, auto("hermes"))
    assert content == "Let me check." and len(calls) == 1
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["type"] == "function"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "days": 2}
    assert calls[0]["id"].startswith("call_")
    two = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {"x": 1}}'
    assert [c["function"]["name"] for c in parse(two, auto("hermes"))[1]] == ["a", "b"]
    llama = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome", "days": 1}}'
    content, calls = parse(llama, auto("llama3_json"))
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"city": "Rome", "days": 1}
    mistral = (
        '[TOOL_CALLS] [{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Rome"}}]'
    )
    assert [c["function"]["name"] for c in parse(mistral, auto("mistral"))[1]] == ["get_time", "get_weather"]
    for parser in ("hermes", "llama3_json", "mistral"):
        assert parse("Just an answer {not a call}.", auto(parser)) == ("Just an answer {not a call}.", [])
    forced = ToolPlan([WEATHER], "required", "forced")
    assert parse('[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]', forced)[1][0]["function"][
        "name"] == "get_weather"  # fmt: skip
    named = ToolPlan([WEATHER], "get_weather", "named")
    _, calls = parse('{"city": "Rome", "days": 5}', named)
    assert calls[0]["function"]["name"] == "get_weather"


def stream_pieces(tool_plan: ToolPlan, pieces: list[str], finish: str = "stop") -> tuple[str | None, list, str, list]:
    """Feed `pieces` to a `ToolStream`: (content, calls as {id, name, arguments}, finish, the deltas)."""
    stream, content, calls, deltas = ToolStream(tool_plan), "", {}, []
    for piece in [*pieces, None]:
        if piece is None:
            text, parts, finish = stream.finish(finish)
        else:
            text, parts = stream.feed(piece)
        content += text
        deltas.append((text, parts))
        for part in parts:
            entry = calls.setdefault(part["index"], {"id": None, "name": "", "arguments": ""})
            assert ("id" in part) == (entry["id"] is None)  # id, type and name come once, first
            entry["id"] = part.get("id", entry["id"])
            entry["name"] += part["function"].get("name", "")
            entry["arguments"] += part["function"]["arguments"]
    return content or None, [calls[i] for i in sorted(calls)], finish, deltas


STREAMED = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"ris}", "days": 2}}\n'
     "</tool_call>"),
    ("hermes", '<tool_call>{"name": "a", "arguments": {}}</tool_call> then <tool_call>{"arguments": {"x": [1, '
     '{"y": "}"}]}, "name": "b"}</tool_call>'),
    ("hermes", '  Sure <tool_call>{"name": "a", "arguments": "{\\"q\\": 1}"}</tool_call>'),
    ("hermes", "Just an answer {not a call} <tool_"),
    ("mistral", 'ok [TOOL_CALLS] [{"name": "get_time", "arguments": {}}, {"arguments": {"c": 1}, "name": "w"}, '
     '{"name": "get_weather", "arguments": {"city": "Rome"}, "id": "x}"}]'),
    ("mistral", '[TOOL_CALLS]{"name": "f", "parameters": 5}'),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome", "days": 1}}'),
    ("llama3_json", "plain text"),
    ("forced", '[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, {"name": "t", "arguments": {}}]'),
    ("named", '{"city": "Rome", "days": 5}'),
]  # fmt: skip


@pytest.mark.parametrize(("parser", "text"), STREAMED, ids=[f"{p} {i}" for i, (p, _) in enumerate(STREAMED)])
def test_a_streamed_choice_fed_piece_by_piece_sends_what_the_whole_text_parses_to(parser, text):
    import random

    tool_plan = ToolPlan([WEATHER], "get_weather" if parser == "named" else "auto", parser)
    content, calls = parse(text, tool_plan)
    expected = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls]
    rng = random.Random(len(text))
    for cut in (1, 2, 3, 7, None):  # characters per piece; None: random sizes
        pieces, at = [], 0
        while at < len(text):
            size = cut or rng.randint(1, 9)
            pieces.append(text[at : at + size])
            at += size
        got, got_calls, finish, deltas = stream_pieces(tool_plan, pieces)
        assert got == content and [{k: c[k] for k in ("name", "arguments")} for c in got_calls] == expected, cut
        assert finish == ("tool_calls" if calls else "stop")
        for piece_text, _ in deltas[:-1]:  # markup never reaches the content (a cut-off one at the end may)
            assert "<tool_call" not in piece_text and "TOOL_CALLS" not in piece_text
        streams = parser == "named" or (parser != "llama3_json" and '"arguments": {' in text)  # object arguments
        if streams and cut == 1:  # incremental: some call's arguments arrive in many fragments
            fragments = [p["index"] for _, parts in deltas for p in parts if p["function"]["arguments"]]
            assert max(fragments.count(i) for i in set(fragments)) > 1
    for call in calls:
        json.loads(call["function"]["arguments"])


def test_a_call_cut_off_by_max_tokens_has_streamed_as_far_as_it_got():
    text = 'Hi <tool_call>{"name": "get_weather", "arguments": {"city": "Pa'
    content, calls, finish, _ = stream_pieces(auto("hermes"), list(text), finish="length")
    assert content == "Hi" and calls[0]["name"] == "get_weather" and finish == "length"
    assert calls[0]["arguments"] == '{"city": "Pa'


@pytest.mark.parametrize(
    ("tools", "choice", "message"),
    [
        ([{"type": "function"}], "auto", "tools"),
        ([{"type": "function", "function": {"name": ""}}], "auto", "tools"),
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
        ([WEATHER], "sometimes", "tool_choice"),
        (None, "required", "tool_choice"),
    ],
)
def test_malformed_tools_and_tool_choice_are_400s_naming_the_field(tools, choice, message):
    with pytest.raises(APIError) as info:
        plan(tools, choice, None, "hermes")
    assert info.value.status == 400 and info.value.param == message


def test_required_and_named_choices_carry_a_json_schema_constraint():
    required = plan([WEATHER, TIME], "required", None, None)
    assert required.parser == "forced" and required.constraint.kind == "json_schema"
    named = plan([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}}, None, None)
    assert named.parser == "named" and json.loads(named.constraint.spec) == WEATHER["function"]["parameters"]
    assert plan([WEATHER], "none", None, None) is None


# ---- through the server --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    pytest.importorskip("fastapi")
    pytest.importorskip("xgrammar")
    from transformers import AutoTokenizer

    from tests.serve_helpers import Server, make_model_dir

    path = make_model_dir(tmp_path_factory.mktemp("qwen3-tools"))
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = HERMES_TEMPLATE
    tokenizer.save_pretrained(path)
    engine = ("--max-seqs", "4", "--capacity", "1024", "--max-step-tokens", "64", "--prefill-chunk", "32")
    srv = Server(str(path), "--served-model-name", "tiny", *engine)
    yield srv.wait()
    code, out = srv.stop(signal.SIGTERM)
    assert code == 0, out


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


def streamed_calls(stream) -> tuple[str, list[dict], str | None]:
    text, calls, finish = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = call.id or entry["id"]
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return text, [calls[i] for i in sorted(calls)], finish


def test_tool_call_round_trip_with_required_named_and_auto(client):
    args = {"model": "tiny", "tools": [WEATHER, TIME], "max_tokens": 100, "temperature": 0.7, "seed": 2}
    schema = WEATHER["function"]["parameters"]
    jsonschema = pytest.importorskip("jsonschema")
    # required: the output is constrained to calls of the given tools
    out = client.chat.completions.create(messages=QUESTION, tool_choice="required", **args).choices[0]
    assert out.finish_reason == "tool_calls" and out.message.tool_calls
    for call in out.message.tool_calls:
        assert call.function.name in ("get_weather", "get_time") and call.type == "function"
        if call.function.name == "get_weather":
            jsonschema.validate(json.loads(call.function.arguments), schema)
    # named, streamed: the arguments of that function
    named = {"type": "function", "function": {"name": "get_weather"}}
    _, calls, finish = streamed_calls(
        client.chat.completions.create(messages=QUESTION, tool_choice=named, stream=True, **args)
    )
    assert finish == "tool_calls" and len(calls) == 1 and calls[0]["name"] == "get_weather" and calls[0]["id"]
    jsonschema.validate(json.loads(calls[0]["arguments"]), schema)
    # auto: the template's Hermes format, parsed (a regex makes the random model write one)
    call_text = (
        r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "days": [1-7]\}\}</tool_call>'
    )
    out = client.chat.completions.create(messages=QUESTION, tool_choice="auto", extra_body={"guided_regex": call_text},
                                         **args).choices[0]  # fmt: skip
    assert out.finish_reason == "tool_calls" and out.message.content is None
    (call,) = out.message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), schema)
    # the call and its result go back in the history; the answer is text
    history = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}]  # fmt: skip
    final = client.chat.completions.create(messages=history, **{**args, "max_tokens": 8}).choices[0]
    assert final.finish_reason in ("stop", "length") and not final.message.tool_calls
    assert isinstance(final.message.content, str)


def test_the_history_with_a_tool_result_reaches_the_template(server):
    import httpx
    from transformers import AutoTokenizer

    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    history = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "noon"}]  # fmt: skip
    body = {"messages": history, "max_tokens": 1, "return_token_ids": True}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    tokenizer = AutoTokenizer.from_pretrained(server.proc.args[server.proc.args.index("--model") + 1])
    rendered = tokenizer.apply_chat_template(
        [*QUESTION, {"role": "assistant", "content": "", "tool_calls": [{**call, "function": {"name": "get_time",
         "arguments": {}}}]}, {"role": "tool", "tool_call_id": "call_1", "content": "noon"}],
        tokenize=False, add_generation_prompt=True,
    )  # fmt: skip
    assert "<tool_response>noon</tool_response>" in rendered and "<tool_call>" in rendered
    assert r.json()["prompt_token_ids"] == tokenizer.encode(rendered, add_special_tokens=False)


def test_the_openai_stream_helpers_assemble_fragments_equal_to_the_whole_answers_call(client):
    # the regex makes the random model write text, then one Hermes call; streamed and not, the same seed
    call_text = (
        r'Checking\.\n<tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "days": [1-7]\}\}'
        r"</tool_call>"
    )
    args = {"model": "tiny", "messages": QUESTION, "tools": [WEATHER, TIME], "max_tokens": 100, "temperature": 0.7,
            "seed": 3, "extra_body": {"guided_regex": call_text}}  # fmt: skip
    whole = client.chat.completions.create(**args).choices[0]
    (call,) = whole.message.tool_calls
    fragments, content, done = [], [], []
    with client.chat.completions.stream(**args) as stream:
        for event in stream:
            if event.type == "tool_calls.function.arguments.delta":
                fragments.append(event.arguments_delta)
            elif event.type == "content.delta":
                content.append(event.delta)
            elif event.type == "tool_calls.function.arguments.done":
                done.append((event.name, event.arguments))
        final = stream.get_final_completion().choices[0]
    assert whole.finish_reason == final.finish_reason == "tool_calls"
    assert len(fragments) > 1 and "".join(fragments) == call.function.arguments  # incremental, and equal
    assert done == [("get_weather", call.function.arguments)] and json.loads(call.function.arguments)["days"] >= 1
    (streamed,) = final.message.tool_calls
    assert (streamed.function.name, streamed.type) == ("get_weather", "function")
    assert streamed.function.arguments == call.function.arguments
    assert streamed.id and streamed.id.startswith("call_")
    assert "".join(content) == whole.message.content == final.message.content == "Checking."  # no markup
