"""The package stays readable: no module in `batchkv/` over 400 lines and no function over 80,
except the Triton kernels (`@triton.jit`: one kernel is one launch, split only by `tl.constexpr`
helpers) and the allow-listed names below, each with the reason it is there. Shrink the list; do
not grow it."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "batchkv"
MOST_LINES = 400
MOST_FUNCTION_LINES = 80

# path relative to batchkv/ -> why it may be longer (none today)
LONG_FILES: dict[str, str] = {}
# (path, function) -> why (none today)
LONG_FUNCTIONS: dict[tuple[str, str], str] = {}


def _modules() -> list[tuple[str, str]]:
    return [(path.relative_to(PACKAGE).as_posix(), path.read_text()) for path in sorted(PACKAGE.rglob("*.py"))]


def _is_kernel(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """Decorated `@triton.jit` (or `@jit`)."""
    for decorator in node.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
        if name == "jit":
            return True
    return False


def test_no_module_in_the_package_is_over_400_lines():
    long = {name: text.count("\n") for name, text in _modules() if text.count("\n") > MOST_LINES}
    assert set(long) - set(LONG_FILES) == set(), f"split these by job: {long}"


def test_no_function_outside_the_triton_kernels_is_over_80_lines():
    long = {}
    for name, text in _modules():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _is_kernel(node):
                lines = node.end_lineno - node.lineno + 1
                if lines > MOST_FUNCTION_LINES and (name, node.name) not in LONG_FUNCTIONS:
                    long[(name, node.name)] = lines
    assert long == {}, f"split these: {long}"


def test_the_allow_lists_name_only_what_exists():
    modules = dict(_modules())
    assert set(LONG_FILES) <= set(modules)
    for name, function in LONG_FUNCTIONS:
        assert f"def {function}(" in modules[name], (name, function)


MOST_BENCH_LINES = 4500  # issue 40: bench/ under 4,500 lines, its results aside


def test_bench_keeps_at_most_12_entry_points():
    """bench/ holds the scripts a user re-runs; their shared parts go to bench/lib/ (a new
    measurement is a part or a flag of an existing entry point, or replaces one)."""
    entry_points = sorted(path.name for path in (PACKAGE.parent / "bench").glob("*.py"))
    assert len(entry_points) <= 12, entry_points


def test_bench_is_under_4500_lines_apart_from_its_results():
    """What `find bench -path bench/results -prune -o -type f -print | xargs wc -l` counts (compiled
    caches aside): a new measurement replaces code or folds into what is there."""
    bench = PACKAGE.parent / "bench"
    files = [path for path in bench.rglob("*") if path.is_file() and path.relative_to(bench).parts[0] != "results"
             and "__pycache__" not in path.parts]  # fmt: skip
    lines = {path.relative_to(bench).as_posix(): path.read_bytes().count(b"\n") for path in files}
    assert sum(lines.values()) < MOST_BENCH_LINES, sorted(lines.items(), key=lambda item: -item[1])
