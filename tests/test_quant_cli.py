"""`--quantization fp8` on the command line: `batchkv run` serves the tiny preset with e4m3 projections,
and an unknown choice is refused by the parser."""

from __future__ import annotations

import json

import pytest
import torch

from batchkv import cli


def test_run_with_quantization_fp8_serves_the_workload(tmp_path, capsys):
    out = tmp_path / "metrics.json"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        argv = ["run", "--device", "cpu", "--requests", "3", "--prompt-len", "4:12", "--output-len", "2:4",
                "--quantization", "fp8", "--json", str(out)]  # fmt: skip
        assert cli.main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    metrics = json.loads(out.read_text())
    assert metrics["requests_submitted"] == 3 and 3 * 2 <= metrics["generated_tokens"] <= 3 * 4


def test_an_unknown_quantization_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["run", "--device", "cpu", "--quantization", "int4"])
    assert exc.value.code == 2 and "int4" in capsys.readouterr().err
