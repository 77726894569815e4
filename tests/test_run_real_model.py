"""`batchkv run --model PATH` replays the workload on a real model (a GGUF file or a transformers
directory), and refuses a path that is neither."""

from __future__ import annotations

import json

import pytest

from batchkv import cli
from tests.real_model import gguf_path, model_dir


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = cli.main(list(argv))
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def test_run_refuses_a_model_that_is_neither_a_preset_nor_a_path(capsys, tmp_path):
    code, _, err = _run(capsys, "run", "--model", str(tmp_path / "missing"), "--requests", "1")
    assert code == 2 and "neither a preset" in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
@pytest.mark.parametrize("which", ["gguf", "directory"])
def test_run_replays_a_synthetic_workload_on_a_real_model(capsys, tmp_path, which):
    path = gguf_path() if which == "gguf" else model_dir()
    out_json = tmp_path / "metrics.json"
    argv = ["run", "--model", str(path), "--device", "cpu", "--threads", "2", "--requests", "3",
            "--prompt-len", "6:12", "--output-len", "3:6", "--arrival-gap", "0", "--json", str(out_json)]  # fmt: skip
    code, out, err = _run(capsys, *argv)
    assert code == 0, err
    record = json.loads(out_json.read_text())
    assert record["model"] == str(path) and record["requests_submitted"] == 3
    assert sum(record["finished"].values()) == 3 and record["generated_tokens"] >= 3
    assert "SmolLM2" in out or str(path) in out
