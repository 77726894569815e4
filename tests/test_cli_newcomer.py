"""What a newcomer meets first, through the installed `batchkv` entry point (PYTHONPATH makes it import
this tree): a missing extra is one line that names it, help says what each option does, `run`,
`serve` and `score` share one spelling and one default per option, vLLM's command line works, an
unknown flag points to the subcommand's help, and a real model's run shows and writes its text."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from batchkv import cli

ROOT = Path(__file__).resolve().parents[1]
ENTRY = Path(sys.executable).with_name("batchkv")  # the console script `pip install` wrote
TINY = "sensenova-u1-tiny"


def start(*argv: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`batchkv ARGV` in a subprocess importing this tree (stdout and stderr piped)."""
    if not ENTRY.exists():
        pytest.skip(f"no `batchkv` entry point beside {sys.executable} (pip install -e .)")
    environment = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.Popen([str(ENTRY), *argv], env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip


def finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def assert_one_line(code: int, err: str, *names: str) -> None:
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, (code, err)
    for name in names:
        assert name in err, (name, err)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from tests.serve_helpers import make_model_dir

    return make_model_dir(tmp_path_factory.mktemp("qwen3-tiny"))


@pytest.fixture
def without_transformers(tmp_path) -> dict[str, str]:
    """An environment whose `import transformers` fails as it does where the extra is not installed."""
    fake = tmp_path / "site" / "transformers"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        'raise ModuleNotFoundError("No module named \'transformers\'", name="transformers")\n'
    )
    return {"PYTHONPATH": f"{fake.parent}{os.pathsep}{ROOT}", "BATCHKV_CACHE": str(tmp_path / "cache")}


def test_a_model_directory_without_transformers_is_one_line_naming_the_extra(model_dir, without_transformers, tmp_path):
    text = tmp_path / "prose.txt"
    text.write_text("A short text to score.")
    procs = [
        start("run", "--model", str(model_dir), "--requests", "1", env=without_transformers),
        start("score", "--model", str(model_dir), str(text), env=without_transformers),
        start("serve", str(model_dir), "--port", "0", env=without_transformers),
    ]
    for proc in procs:
        code, _, err = finish(proc)
        assert_one_line(code, err, "DependencyError", "transformers", "pip install 'batchkv[hf]'")


def test_a_gguf_file_without_transformers_is_one_line_naming_the_extra_not_gguf(without_transformers):
    from tests.real_model import gguf_path

    code, _, err = finish(start("run", "--model", str(gguf_path()), "--requests", "1", env=without_transformers))
    assert_one_line(code, err, "DependencyError", "needs transformers", "pip install 'batchkv[hf]'")
    assert "pip install gguf" not in err  # gguf is installed here: the advice names what is missing


def test_help_says_what_each_option_does_once():
    helps = {name: start(name, "--help") for name in ("run", "serve", "score")}
    refused = start("score", "--model", "m", "--kv-dtype", "fp9", "f.txt")
    texts = {}
    for name, proc in helps.items():
        code, out, _ = finish(proc)
        assert code == 0
        texts[name] = " ".join(out.split())  # argparse wraps to the terminal's width
        assert not re.search(r"\(default[^)]*\) \(default", texts[name]), name  # said once
    assert "--prefix-cache, --no-prefix-cache" in texts["run"]  # the flag's on form is the default shown
    assert "reuse the K/V of prompt prefixes" in texts["serve"]
    description = texts["serve"].split(" options:", 1)[0]
    assert "GGUF" in description and "preset" in description
    code, _, err = finish(refused)
    assert code == 2 and "'fp8'" in err and "'bfloat16'" in err  # fp8, the default, among the names


def _options(parser, command: str) -> dict[str, tuple]:
    sub = parser.commands[command]
    return {a.dest: (tuple(a.option_strings), a.default, a.help, a.choices) for a in sub._actions if a.option_strings}


SHARED = ("max_seqs", "memory_fraction", "capacity", "max_step_tokens", "prefill_chunk", "prefill_budget",
          "prefix_cache", "overlap", "graphs", "tensor_parallel", "threads", "kv_dtype", "speculative",
          "spec_block", "device", "dtype", "seed")  # fmt: skip


def test_run_serve_and_score_share_one_spelling_and_default_per_option():
    parser = cli.build_parser()
    run, serve, score = (_options(parser, name) for name in ("run", "serve", "score"))
    for dest in SHARED:
        assert run[dest] == serve[dest], dest
    for dest in ("device", "dtype", "seed", "threads"):
        assert score[dest] == run[dest], dest
    assert run["model"][0] == serve["model"][0] == score["model"][0] == ("-m", "--model")
    for argv in (["run", "--capacity", "auto"], ["serve", "m", "--capacity", "auto"]):
        assert parser.parse_args(argv).capacity == "auto"
    assert parser.parse_args(["run"]).max_step_tokens == "auto"  # sized from the model (sizing.auto_step_tokens)
    assert parser.parse_args(["serve", "m", "--max-num-batched-tokens", "2048"]).max_step_tokens == 2048


def test_vllm_spellings_are_aliases_and_a_memory_fraction_sizes_a_numbered_store():
    from batchkv.cli.options import scheduling_kwargs

    parser = cli.build_parser()
    vllm = ["serve", "/models/x", "--max-num-seqs", "8", "--max-model-len", "2048", "--gpu-memory-utilization", "0.8",
            "--max-num-batched-tokens", "512", "--no-enable-prefix-caching", "--tensor-parallel-size", "2"]  # fmt: skip
    ours = ["serve", "--model", "/models/x", "--max-seqs", "8", "--capacity", "2048", "--memory-fraction", "0.8",
            "--max-step-tokens", "512", "--no-prefix-cache", "--tensor-parallel", "2"]  # fmt: skip
    a, b = parser.parse_args(vllm), parser.parse_args(ours)
    assert (a.model_argument, b.model) == ("/models/x", "/models/x")
    a.model_argument, a.model = None, "/models/x"
    assert vars(a) == vars(b)
    expected = {"max_seqs": 8, "memory_fraction": 0.8, "kv_positions": "auto", "prefill_budget": None,
                "overlap": "auto", "prefix_cache": False}  # fmt: skip
    assert scheduling_kwargs(a, "cpu") == expected
    assert scheduling_kwargs(parser.parse_args(["run", "--max-seqs", "8"]), "cpu")["kv_positions"] is None


def test_serve_takes_a_vllm_command_line_with_the_model_first():
    pytest.importorskip("fastapi")
    from tests.serve_helpers import free_port

    port = free_port()
    proc = start("serve", TINY, "--port", str(port), "--device", "cpu", "-t", "1", "--max-num-seqs", "2",
                 "--max-model-len", "64", "--max-num-batched-tokens", "32", "--gpu-memory-utilization", "1.0",
                 "--enable-prefix-caching", "--tensor-parallel-size", "1")  # fmt: skip
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        assert httpx.get(url + "/v1/models").json()["data"][0]["max_model_len"] == 64
        r = httpx.post(url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 3}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    finally:
        proc.send_signal(signal.SIGTERM)
        code, _, err = finish(proc, timeout=60)
    assert code == 0, err
    assert "max_seqs 2, capacity 64" in err and "sized the store" in err  # the memory fraction was applied


def test_an_unknown_flag_points_to_the_subcommands_help():
    procs = {name: start(name, "--bogus-flag", "3") for name in ("run", "serve", "score")}
    for name, proc in procs.items():
        code, _, err = finish(proc)
        assert_one_line(code, err, "--bogus-flag", f"(see batchkv {name} --help)")


@pytest.mark.slow
def test_run_on_a_gguf_file_replays_text_writes_it_and_says_where_the_converted_copy_lives(tmp_path):
    from tests.real_model import gguf_path

    cache, tokens = tmp_path / "cache", tmp_path / "tokens.jsonl"
    env = {"BATCHKV_CACHE": str(cache)}
    common = ["--model", str(gguf_path()), "--device", "cpu", "-t", "2", "--arrival-gap", "0", "--output", str(tokens)]
    code, out, err = finish(start("run", *common, "--requests", "2", "--output-len", "12:12", env=env), timeout=600)
    assert code == 0, err
    (copy,) = (cache / "gguf").iterdir()
    assert f"wrote {copy}" in err and f"rm -r '{copy}'" in err  # where it lives, how to remove it
    assert json.loads((copy / "config.json").read_text())["dtype"] == "bfloat16"  # the model's own, not float32
    assert (copy / "model.safetensors").stat().st_size < 300 * 2**20  # float32 was 517 MiB
    assert re.search(r"request 0: .*capital of France.* -> \S", out), out  # a few words, not only numbers
    rows = [json.loads(line) for line in tokens.read_text().splitlines()]
    assert len(rows) == 2 and all(len(r["tokens"]) >= 1 and r["text"].strip() for r in rows)
    workload = tmp_path / "w.jsonl"
    lines = [
        '{"prompt": "The capital of France is", "max_new_tokens": 4}',
        '{"prompt_ids": [1, 2, 3], "max_new_tokens": 5}',
    ]
    workload.write_text("\n".join(lines) + "\n")
    code, out, err = finish(start("run", *common, "--workload", str(workload), env=env), timeout=600)
    assert code == 0 and "converting" not in err, err  # read from the cache
    rows = [json.loads(line) for line in tokens.read_text().splitlines()]
    assert [r["request_id"] for r in rows] == [0, 1] and 1 <= len(rows[0]["tokens"]) <= 4
    assert 1 <= len(rows[1]["tokens"]) <= 5 and all(isinstance(r["text"], str) for r in rows)
