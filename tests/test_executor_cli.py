"""`batchkv run` end to end on a tiny workload, and the workload generator and reader behind it."""

from __future__ import annotations

import argparse
import gc
import importlib
import json

import pytest
import torch

from batchkv import cli
from batchkv.cli import run as cli_run
from batchkv.cli.workload import load_jsonl, synthetic
from batchkv.errors import WorkloadError
from tests.toy_model import ToyModel


@pytest.fixture(autouse=True)
def tiny_model(monkeypatch):
    """The SenseNova tiny preset when the models package is present, else the toy model."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    if not hasattr(importlib.import_module("batchkv.models"), "build_model"):
        from batchkv.serve.loading import ServedModel

        toy = lambda args, device: ServedModel(ToyModel(seed=args.seed, device=device), "preset")  # noqa: E731
        monkeypatch.setattr(cli_run, "load_model", toy)
    yield
    torch.set_num_threads(threads)


def test_run_replays_a_synthetic_workload_and_prints_a_summary(tmp_path, capsys):
    out = tmp_path / "metrics.json"
    argv = ["run", "--device", "cpu", "--requests", "6", "--prompt-len", "4:20", "--output-len", "2:8"]
    assert cli.main([*argv, "--arrival-gap", "2", "--json", str(out), "--progress", "on"]) == 0
    captured = capsys.readouterr()
    for label in ("requests", "tokens/s", "inter-token p50", "inter-token p99", "graphs"):
        assert label in captured.out
    assert "6/6 done" in captured.err  # the progress bar's last state
    metrics = json.loads(out.read_text())
    assert metrics["requests_submitted"] == 6 and metrics["requests_refused"] == 0
    assert 6 * 2 <= metrics["generated_tokens"] <= 6 * 8
    assert metrics["device"] == "cpu" and metrics["graphs"] is False and metrics["tokens_per_s"] > 0


def test_run_freezes_the_heap_before_its_workload(monkeypatch, capsys):
    from batchkv.cli import workload

    frozen, replay = [], workload.replay

    def counted(*args, **kwargs):
        frozen.append(gc.get_freeze_count())
        return replay(*args, **kwargs)

    monkeypatch.setattr(workload, "replay", counted)
    assert gc.get_freeze_count() == 0  # conftest unfreezes after every test
    assert cli.main(["run", "--device", "cpu", "--requests", "2", "--prompt-len", "4:6", "--output-len", "2:3"]) == 0
    assert len(frozen) == 1 and frozen[0] > 0 and "tokens/s" in capsys.readouterr().out


def test_run_replays_a_jsonl_workload_and_reports_refusals(tmp_path, capsys):
    path, out = tmp_path / "work.jsonl", tmp_path / "m.json"
    lines = [
        {"prompt_ids": [1, 2, 3], "max_new_tokens": 4},
        {"prompt_ids": list(range(40)), "max_new_tokens": 4},  # too long for --capacity 32
        {"prompt_ids": [5, 6], "max_new_tokens": 3, "temperature": 0.8, "seed": 1, "n": 2, "arrival_step": 2},
    ]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    argv = ["run", "--device", "cpu", "--workload", str(path), "--capacity", "32", "--json", str(out)]
    assert cli.main(argv) == 1  # a refused request makes the run fail, so scripts notice
    captured = capsys.readouterr()
    assert "request 1 refused" in captured.err and "capacity is 32" in captured.err
    assert "1 of 3 requests were refused" in captured.err and "--allow-refused" in captured.err
    assert cli.main([*argv, "--allow-refused"]) == 0
    assert "were refused" not in capsys.readouterr().err
    metrics = json.loads(out.read_text())
    assert metrics["requests_submitted"] == 2 and metrics["requests_refused"] == 1
    assert metrics["generated_tokens"] == 4 + 2 * 3


def test_a_bad_workload_line_names_the_line_and_the_field(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt_ids": [1, 2]}\n{"prompt_ids": [1], "max_new_token": 3}\n')
    assert cli.main(["run", "--device", "cpu", "--workload", str(path)]) == 2
    err = capsys.readouterr().err
    assert "WorkloadError" in err and "bad.jsonl:2" in err and "max_new_token" in err
    path.write_text('{"prompt_ids": [1, 2], "top_p": 0}\n')
    with pytest.raises(WorkloadError, match="top_p"):
        load_jsonl(path)


def test_run_help_documents_every_option():
    parser = argparse.ArgumentParser()
    cli_run.add_run(parser.add_subparsers())
    run = parser._subparsers._group_actions[0].choices["run"]
    options = [a for a in run._actions if a.option_strings and a.dest != "help"]
    assert len(options) >= 15
    assert all(a.help and len(a.help) > 5 for a in options), [a.dest for a in options if not a.help]


def test_synthetic_workloads_are_seeded_and_stay_in_their_ranges():
    items = synthetic(50, vocab_size=97, prompt_len=(3, 9), output_len=(2, 5), arrival_gap=1.5, seed=4)
    again = synthetic(50, vocab_size=97, prompt_len=(3, 9), output_len=(2, 5), arrival_gap=1.5, seed=4)
    assert items == again and items != synthetic(50, vocab_size=97, seed=5)
    assert all(3 <= len(i.request.prompt_ids) <= 9 and 2 <= i.request.params.max_new_tokens <= 5 for i in items)
    assert all(0 <= t < 97 for i in items for t in i.request.prompt_ids)
    steps = [i.arrival_step for i in items]
    assert steps == sorted(steps) and 0 < steps[-1] < 50 * 5  # staggered, mean gap 1.5
    assert len({i.request.params.seed for i in items}) == 50
    with pytest.raises(WorkloadError, match="prompt_len"):
        synthetic(3, vocab_size=97, prompt_len=(5, 2))


def test_run_sizes_the_store_to_memory_and_reports_what_it_chose(tmp_path, capsys, monkeypatch):
    from batchkv.executor import sizing

    monkeypatch.setattr(sizing, "device_memory", lambda device: (64 << 30, 1 << 30))  # not this machine's load
    out = tmp_path / "m.json"
    argv = ["run", "--device", "cpu", "--requests", "4", "--prompt-len", "4:12", "--output-len", "2:6"]
    argv += ["--max-seqs", "auto", "--memory-fraction", "0.5", "--capacity", "64", "--prefill-budget", "8"]
    assert cli.main([*argv, "--overlap", "off", "--json", str(out)]) == 0
    captured = capsys.readouterr()
    # auto: 1,024 sequences (the step budget's 1,024 rows), whose 64 positions each bound the pool
    assert "sized the store: a pool of 65536 positions for at most 1024 sequences" in captured.err
    for label in ("first token p99", "step time", "store", "max_seqs 1024, capacity 64, prefill budget 8"):
        assert label in captured.out
    metrics = json.loads(out.read_text())
    assert (
        metrics["max_seqs"] == 1024 and metrics["overlap"] is False and metrics["sizing"].startswith("a pool of 65536")
    )
    assert metrics["prefill_budget"] == 8
    assert metrics["generated_tokens"] >= 4 * 2


def test_run_refuses_a_max_seqs_that_is_neither_a_number_nor_auto(capsys):
    with pytest.raises(SystemExit):
        cli.main(["run", "--device", "cpu", "--max-seqs", "many"])
    assert "'many' is not an integer, nor auto" in capsys.readouterr().err


def test_a_workload_line_carries_its_priority(tmp_path):
    path = tmp_path / "work.jsonl"
    path.write_text('{"prompt_ids": [1, 2]}\n{"prompt_ids": [3], "priority": 2}\n')
    assert [item.request.priority for item in load_jsonl(path)] == [0, 2]
    path.write_text('{"prompt_ids": [1], "priority": 4294967296}\n')
    with pytest.raises(WorkloadError, match=":1: priority"):
        load_jsonl(path)
