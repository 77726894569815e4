"""The CLI never shows a traceback for a user error: one line on stderr and a non-zero exit status,
checked through real processes (`python -m batchkv`) and, for the many smaller cases, in process."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import batchkv
from batchkv import cli
from batchkv.cli import run as cli_run
from batchkv.cli.workload import JSONL_HELP, _Line
from batchkv.executor import Engine

ROOT = Path(__file__).resolve().parents[1]
TINY = "sensenova-u1-tiny"


def batchkv_process(*argv: str, **kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-m", "batchkv", *argv],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        **kw,
    )


def assert_one_line_error(code: int, out: str, err: str, *names: str, status: int = 2) -> None:
    assert code == status, (code, out, err)
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert out == "", out  # refused before anything ran
    for name in names:
        assert name in err, (name, err)


def test_user_errors_through_real_processes_are_one_line_and_exit_2(tmp_path):
    cases = {
        "missing workload": (("run", "--workload", str(tmp_path / "nope.jsonl")), ("--workload", "nope.jsonl")),
        "absurd max-seqs": (("run", "--max-seqs", "2000000000", "--requests", "1"), ("CapacityError", "bytes")),
    }
    procs = {name: batchkv_process(*argv) for name, (argv, _) in cases.items()}
    version = batchkv_process("--version")
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        assert_one_line_error(proc.returncode, out.decode(), err.decode(), *cases[name][1])
    out, err = version.communicate(timeout=120)
    assert (version.returncode, out.decode().strip(), err) == (0, f"batchkv {batchkv.__version__}", b"")


def default_sigint() -> None:
    """A child's Ctrl-C as in a terminal, even under a shell job started with `&`, whose children
    inherit SIGINT ignored (Python then installs no KeyboardInterrupt handler)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_stops_a_run_and_prints_the_summary_of_what_finished(tmp_path):
    tokens = tmp_path / "tokens.jsonl"
    argv = ("run", "--requests", "3000", "--arrival-gap", "0", "--progress", "on", "--output", str(tokens))
    proc = batchkv_process(*argv, bufsize=0, preexec_fn=default_sigint)
    timer = threading.Timer(120, proc.kill)
    timer.start()
    seen = b""
    while b"done" not in seen:  # the progress bar is drawn once the first step ran
        byte = proc.stderr.read(1)
        assert byte, seen
        seen += byte
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate()
    timer.cancel()
    err = (seen + err).decode()
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert "requests" in out.decode() and "interrupted" in err
    lines = [json.loads(line) for line in tokens.read_text().splitlines()]
    assert len(lines) == 3000 and any(line["finish_reason"] is None for line in lines)


# ---- in process: the same guarantees for every other user error ---------------------------------
@pytest.fixture
def tiny_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    try:
        code = cli.main(list(argv))
    except SystemExit as exc:  # argparse's own exits (--help, a bad option)
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def test_every_user_error_is_one_line_without_a_traceback(tmp_path, capsys, tiny_threads):
    workload = tmp_path / "w.jsonl"
    workload.write_text('{"prompt_ids": [1, 2]}\n')
    garbage = tmp_path / "garbage.jsonl"
    garbage.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    head24 = tmp_path / "h24.json"
    head24.write_text(
        (ROOT / "manifests" / "sensenova-u1-8b-sequence.json").read_text().replace('"head_dim": 128', '"head_dim": 24')
    )
    cuda, h = torch.cuda.is_available(), str(tmp_path / "h.json")
    folder = tmp_path / "d.json"  # a folder where export would write its file
    folder.mkdir()
    cases = [
        (("run", "--workload", str(tmp_path)), ("--workload", "directory")),
        (("run", "--workload", str(garbage)), ("WorkloadError", "garbage.jsonl:1")),
        (("run", "--workload", str(workload), "--json", str(tmp_path)), ("--json", "directory")),
        (("run", "--workload", str(workload), "--json", str(tmp_path / "no" / "m.json")), ("--json", "no/m.json")),
        (("run", "--workload", str(workload), "--output", str(tmp_path / "x" / "t.jsonl")), ("--output",)),
        (("run", "--max-seqs", "0"), ("--max-seqs",)),
        (("run", "--threads", "-1"), ("--threads", "-1", "see batchkv run --help")),
        (("run", "--capacity", "1e9"), ("--capacity", "not an integer")),
        (("run", "--top-p", "0"), ("--top-p",)),
        (("run", "--temperature", "nan"), ("--temperature",)),
        (("run", "--prefill-chunk", "100", "--capacity", "64"), ("prefill_chunk", "64")),
        (("run", "--prompt-len", "9:3"), ("--prompt-len",)),
        (("inspect", str(tmp_path)), (str(tmp_path),)),
        (("inspect", str(head24)), ("$.head_dim", "24")),
        (("export", "--preset", TINY, "--kv-layout", "sequence", "--capacity", "64", "-o", str(folder)), ("d.json",)),
        (("export", "--kv-layout", "sequence", "--capacity", "64", "-o", "m.json"), ("--preset",)),
        (
            ("export", "--preset", TINY, "--head-dim", "24", "--kv-layout", "sequence", "--capacity", "64", "-o", h),
            ("--head-dim", "a multiple of 16 from 16 to 256"),
        ),
    ]
    if not cuda:
        cases += [
            (("run", "--graphs", "on", "--device", "cpu"), ("--graphs on",)),
            (("run", "--graphs", "on"), ("--graphs on",)),
            (("run", "--device", "cuda"), ("--device cpu",)),
        ]
    for argv, names in cases:
        code, out, err = run_cli(capsys, *argv)
        try:
            assert_one_line_error(code, out, err, *names)
        except AssertionError as exc:
            raise AssertionError(f"{argv}: {exc}") from None
    assert sorted(os.listdir(tmp_path)) == ["d.json", "garbage.jsonl", "h24.json", "w.jsonl"]  # nothing left behind


def test_serve_refuses_a_bad_option_or_an_address_in_use_in_one_line_before_loading_a_model(capsys, monkeypatch):
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from batchkv.serve import loading

    monkeypatch.setattr(loading, "load_served_model", lambda *a, **k: pytest.fail("a model was loaded"))
    serve = ("serve", "--model", TINY, "--device", "cpu")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        cases = [
            (("--port", port), ("cannot listen", f"127.0.0.1:{port}", "--port")),  # uvicorn: exit 3, four log lines
            (("--port", "99999"), ("--port", "99999")),  # was a traceback
            (("--threads", "-1"), ("--threads",)),  # was a traceback
            (("--capacity", "0"), ("--capacity",)),  # was served with the default capacity
            (("--max-waiting", "-3"), ("--max-waiting",)),  # was a server that refused every request
            (("--drain-timeout", "nan"), ("--drain-timeout",)),
            (("--max-seqs", "lots"), ("--max-seqs", "nor auto")),
            (("--memory-fraction", "0"), ("--memory-fraction",)),
            (("--prefill-budget", "0"), ("--prefill-budget",)),
            (("--overlap", "sometimes"), ("--overlap",)),
        ]
        for argv, names in cases:
            code, out, err = run_cli(capsys, *serve, *argv)
            try:
                assert_one_line_error(code, out, err, *names)
            except AssertionError as exc:
                raise AssertionError(f"{argv}: {exc}") from None


@pytest.mark.skipif(torch.cuda.is_available(), reason="the advice for a machine without a GPU")
def test_the_8b_advice_on_a_machine_without_a_gpu_does_not_send_the_user_in_a_circle(capsys):
    for argv in (("run", "--model", "sensenova-u1-8b"), ("run", "--model", "sensenova-u1-8b", "--device", "cuda")):
        code, out, err = run_cli(capsys, *argv)
        assert_one_line_error(code, out, err, f"--model {TINY}")
        advice = err.split(";", 1)[1]
        assert "--device cuda" not in advice and "--device cpu" not in advice, err


def test_help_documents_the_workload_and_tokens_formats_and_export_its_layouts(capsys):
    code, out, _ = run_cli(capsys, "run", "--help")
    assert code == 0
    for field in _Line.__struct_fields__:
        assert f"  {field} " in JSONL_HELP and f"  {field} " in out, field
    example = json.loads(JSONL_HELP.splitlines()[-1])
    assert set(example) <= set(_Line.__struct_fields__) and "prompt_ids" in example
    assert '"finish_reason"' in out and "--allow-refused" in out and "130" in out
    code, out, _ = run_cli(capsys, "export", "--help")
    assert code == 0 and "Write a manifest" in out
    for layout in ("sequence:", "batched-sequence:", "cell:"):
        assert layout in " ".join(out.split()), layout


def test_an_interrupted_run_writes_what_finished_and_exits_130(tmp_path, capsys, monkeypatch, tiny_threads):
    step, calls = Engine.step, [0]

    def interrupted_step(self):
        calls[0] += 1
        if calls[0] == 10:
            raise KeyboardInterrupt
        return step(self)

    monkeypatch.setattr(Engine, "step", interrupted_step)
    tokens, metrics = tmp_path / "t.jsonl", tmp_path / "m.json"
    argv = ("run", "--requests", "6", "--output-len", "8:8", "--output", str(tokens), "--json", str(metrics))
    code, out, err = run_cli(capsys, *argv)
    assert code == 130 and "requests" in out and "interrupted" in err and "Traceback" not in err
    lines = [json.loads(line) for line in tokens.read_text().splitlines()]
    assert [line["request_id"] for line in lines] == list(range(6))
    finished = [line for line in lines if line["finish_reason"] == "length"]
    assert finished and len(finished) < 6 and all(len(line["tokens"]) == 8 for line in finished)
    assert json.loads(metrics.read_text())["interrupted"] is True


def test_run_output_holds_every_requests_tokens_as_the_engine_streamed_them(tmp_path, capsys, tiny_threads):
    path, tokens = tmp_path / "w.jsonl", tmp_path / "t.jsonl"
    lines = [
        {"prompt_ids": [1, 2, 3], "max_new_tokens": 4},
        {"prompt_ids": list(range(40)), "max_new_tokens": 4},  # refused: --capacity 32
        {"prompt_ids": [5, 6], "max_new_tokens": 3, "temperature": 0.8, "seed": 1, "n": 2, "stop_token_ids": [7]},
    ]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    argv = ("run", "--workload", str(path), "--capacity", "32", "--output", str(tokens), "--allow-refused")
    assert run_cli(capsys, *argv)[0] == 0
    rows = [json.loads(line) for line in tokens.read_text().splitlines()]
    assert [(r["request_id"], r["sample"]) for r in rows] == [(0, 0), (1, 0), (2, 0), (2, 1)]
    assert rows[1]["finish_reason"] == "refused" and "capacity is 32" in rows[1]["error"] and rows[1]["tokens"] == []
    assert len(rows[0]["tokens"]) == 4 and rows[0]["finish_reason"] == "length"
    for row in rows[2:]:
        assert row["finish_reason"] in ("stop", "length") and 1 <= len(row["tokens"]) <= 3
        assert (row["finish_reason"] == "stop") == (row["tokens"][-1] == 7)
    again = tmp_path / "again.jsonl"
    assert run_cli(capsys, *argv[:-3], "--output", str(again), "--allow-refused")[0] == 0
    assert again.read_text() == tokens.read_text()  # seeded: the same run gives the same file


def test_python_dash_m_and_the_console_script_share_one_entry_point():
    assert (ROOT / "batchkv" / "__main__.py").read_text().count("main()") == 1
    assert cli_run.CPU_MODEL in cli_run.MODELS
