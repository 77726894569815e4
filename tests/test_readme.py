"""The README's Python examples run as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_the_readme_has_python_examples():
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_a_readme_example_runs(index, capsys):
    if "packaged_gguf()" in BLOCKS[index]:
        from tests.real_model import gguf_path

        gguf_path()  # the real-model example skips, saying what to install, where the model is absent
    exec(compile(BLOCKS[index], f"README.md[python {index}]", "exec"), {})


def test_the_ci_runs_the_readme_test_command():
    command = re.search(r"Install and run the tests.*?```bash\n(.*?)\n```", README.read_text(), flags=re.S).group(1)
    assert command in (README.parent / ".ci" / "run").read_text()


def test_the_readme_states_the_package_line_count_as_it_is_counted():
    stated = int(re.search(r"about ([\d,]+) lines of Python", README.read_text()).group(1).replace(",", ""))
    package = README.parent / "batchkv"
    files = sorted(package.rglob("*.py"))
    counted = sum(len(f.read_bytes().splitlines()) for f in files)
    assert abs(stated - counted) <= 0.05 * counted, f"README says about {stated} lines; the package has {counted}"
