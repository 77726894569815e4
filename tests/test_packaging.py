"""What the package promises about its dependencies: the CPU path needs neither Triton nor
transformers, a missing optional dependency is a DependencyError naming the extra, `batchkv --help`
and `--version` answer without importing torch, and the ranges in pyproject.toml are the ones the
code states."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import batchkv
from batchkv import cli
from batchkv.models import hf

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = (ROOT / "pyproject.toml").read_text()

WITHOUT_OPTIONALS = """
import sys
sys.modules["triton"] = sys.modules["transformers"] = None  # as if neither were installed
from batchkv import BatchedSequenceCache, CacheConfig
from batchkv.errors import DependencyError
from batchkv.executor import Engine, Request, SamplingParams
from batchkv.models import build_model

engine = Engine(build_model("sensenova-u1-tiny"), max_seqs=2, capacity=64, max_step_tokens=16, prefill_chunk=8)
engine.submit(Request([1, 2, 3], SamplingParams(max_new_tokens=3)))
assert len(engine.run_until_done()) == 3
for attempt in (
    lambda: BatchedSequenceCache(CacheConfig(1, 1, 16, max_seqs=1, capacity=8), attention="triton"),
    lambda: __import__("batchkv.models.hf"),
):
    try:
        attempt()
    except DependencyError as exc:
        print(exc)
    else:
        raise AssertionError("no DependencyError")
"""


def test_the_cpu_path_runs_without_triton_or_transformers_and_says_which_extra_is_missing():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", WITHOUT_OPTIONALS], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    triton, transformers = done.stdout.splitlines()
    assert "pip install 'batchkv[triton]'" in triton and "attention='reference'" in triton
    assert "pip install 'batchkv[hf]'" in transformers and hf.TRANSFORMERS_RANGE in transformers


WITHOUT_SERVE = """
import sys
for name in ("fastapi", "starlette", "uvicorn", "prometheus_client"):  # as if `pip install .` alone
    sys.modules[name] = None
from batchkv.cli import main
sys.exit(main(["run", "--requests", "2", "--prompt-len", "4:6", "--output-len", "2:3"]))
"""


def test_batchkv_run_works_without_the_serve_extra():
    # The README's main command installs no extra: building the CLI (which describes `serve` too)
    # must not import the HTTP stack.
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", WITHOUT_SERVE], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "generated" in done.stdout or "tokens" in done.stdout


WITHOUT_TORCH = """
import runpy, sys
sys.argv = ["batchkv", {arg!r}]
try:
    if {entry!r} == "console script":  # pyproject's [project.scripts] batchkv = "batchkv.cli:main"
        from batchkv.cli import main
        sys.exit(main())
    runpy.run_module("batchkv", run_name="__main__", alter_sys=True)  # python -m batchkv
except SystemExit as exc:
    assert exc.code in (0, None), exc.code
imported = sorted(name for name in sys.modules if name == "torch" or name.startswith("torch."))
assert not imported, "imported " + ", ".join(imported[:5])
"""


@pytest.mark.parametrize("entry", ["console script", "python -m"])
@pytest.mark.parametrize("arg", ["--help", "-h", "--version"])
def test_help_and_version_answer_without_importing_torch(arg, entry):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    code = WITHOUT_TORCH.format(arg=arg, entry=entry)
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"batchkv {batchkv.__version__}" if arg == "--version" else "usage: batchkv")


def test_the_quick_top_level_help_is_the_full_parsers():
    assert cli.build_parser(full=False).format_help() == cli.build_parser().format_help()


def extra(name: str) -> str:
    return re.search(rf"^{name} = \[(.*?)\]$", PYPROJECT, flags=re.M | re.S).group(1)


def test_pyproject_states_the_ranges_the_code_supports():
    assert f'"transformers{hf.TRANSFORMERS_RANGE}"' in extra("hf")
    assert "triton>=3.6,<3.10" in extra("triton")  # 3.6 on the H200, 3.9 in CI
    dependencies = re.search(r"^dependencies = \[(.*?)\]$", PYPROJECT, flags=re.M | re.S).group(1)
    assert "triton" not in dependencies and "transformers" not in dependencies
    assert re.search(r'^version = "(.*)"$', PYPROJECT, flags=re.M).group(1) == batchkv.__version__
    assert re.search(r'license = \{ text = "(.*)" \}', PYPROJECT).group(1) == "Apache-2.0"
    assert "Apache License" in (ROOT / "LICENSE").read_text() and "Version 2.0" in (ROOT / "LICENSE").read_text()
