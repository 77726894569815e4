"""Constraints in `batchkv run --workload`: JSONL lines carry {kind: spec}; the entry point binds
the model's tokenizer and every constrained line's text is inside its language."""

from __future__ import annotations

import json

import jsonschema
import pytest
import regex
import torch

from batchkv import cli
from batchkv.cli.workload import load_jsonl
from batchkv.errors import WorkloadError
from tests.serve_helpers import make_model_dir

SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "size": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["ok", "size"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("qwen3-workload"))


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_run_keeps_each_constrained_workload_line_inside_its_language(model_dir, tmp_path, capsys, one_thread):
    lines = [
        {"prompt": "the cat", "max_new_tokens": 12, "constraint": {"regex": "[0-9]{2,4}-[a-c]+"}},
        {"prompt": "a dog", "max_new_tokens": 8, "constraint": {"choice": ["red", "green", "blue"]}, "n": 2,
         "temperature": 0.9, "seed": 3},
        {"prompt": "the sun", "max_new_tokens": 40, "constraint": {"json_schema": SCHEMA}},
        {"prompt": "the sun", "max_new_tokens": 40, "constraint": {"json_schema": json.dumps(SCHEMA)}},
        {"prompt": "hello", "max_new_tokens": 6, "constraint": {"grammar": 'root ::= "ab" root | "c"'}},
        {"prompt": "hello", "max_new_tokens": 5},  # unconstrained neighbour
    ]  # fmt: skip
    path, tokens = tmp_path / "w.jsonl", tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    argv = ["run", "--model", str(model_dir), "--device", "cpu", "--workload", str(path), "--output", str(tokens)]
    assert cli.main(argv) == 0, capsys.readouterr().err
    rows = {(r["request_id"], r["sample"]): r for r in map(json.loads, tokens.read_text().splitlines())}
    assert len(rows) == 7
    assert regex.fullmatch("[0-9]{2,4}-[a-c]+", rows[0, 0]["text"]) or rows[0, 0]["finish_reason"] == "length"
    assert regex.fullmatch("[0-9]{2,4}-[a-c]*", rows[0, 0]["text"])  # a prefix of the language at least
    for sample in (0, 1):
        assert rows[1, sample]["text"] in ("red", "green", "blue") and rows[1, sample]["finish_reason"] == "stop"
    for request in (2, 3):
        assert rows[request, 0]["finish_reason"] == "stop"
        jsonschema.validate(json.loads(rows[request, 0]["text"]), SCHEMA)
    assert rows[2, 0]["tokens"] == rows[3, 0]["tokens"]  # the schema as an object or as its text: one constraint
    assert regex.fullmatch("(ab)*c?", rows[4, 0]["text"])
    assert rows[5, 0]["finish_reason"] in ("stop", "length") and rows[5, 0]["tokens"]


def test_a_constrained_line_on_a_model_without_a_tokenizer_is_refused_naming_the_workload(tmp_path, capsys):
    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt_ids": [1, 2, 3], "constraint": {"regex": "[0-9]+"}}\n')
    code = cli.main(["run", "--device", "cpu", "--workload", str(path), "--capacity", "32"])
    err = capsys.readouterr().err
    assert code == 2 and "--workload" in err and "constraint" in err and "tokenizer" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("constraint", "words"),
    [
        ({"regex": "a", "choice": ["b"]}, "one key"),
        ({"pattern": "a"}, "one key"),
        ("[0-9]+", "one key"),
        ({"json_object": False}, "json_object"),
        ({"json_schema": [1, 2]}, "JSON schema is an object"),
        ({"json_schema": "{nope"}, "not valid JSON"),
        ({"choice": []}, "non-empty list"),
        ({"regex": ""}, "non-empty string"),
    ],
)
def test_a_bad_constraint_on_a_workload_line_names_the_line_and_the_rule(tmp_path, constraint, words):
    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt_ids": [1]}\n' + json.dumps({"prompt_ids": [1], "constraint": constraint}) + "\n")
    with pytest.raises(WorkloadError, match=r"w\.jsonl:2: ") as info:
        load_jsonl(path)
    assert words in str(info.value) and "constraint" in str(info.value)


def test_a_json_object_line_reads_as_any_json_object(tmp_path):
    from batchkv.executor.constraints import Constraint

    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt_ids": [1], "constraint": {"json_object": true}}\n')
    assert load_jsonl(path)[0].request.params.constraint == Constraint.json_schema(None)
