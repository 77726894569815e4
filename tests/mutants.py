"""Mutation check: small changes to the code, each of which some named tests must catch.

Each `Mutant` replaces one exact piece of text in one file (it must occur exactly once) and names
the pytest selection that must then fail. The check copies the repository to a temporary
directory once, runs every selection there unchanged (they must pass), then applies each mutant
alone, runs its selection with a time limit and puts the file back. Nothing in the working tree
is touched. Not collected by pytest and not run by CI: run it by hand after changing the code it
covers (a mutant whose text is gone is reported `stale`: re-locate it, do not drop it).

    python -m tests.mutants                 # every mutant
    python -m tests.mutants pool 7          # mutants whose name contains "pool", and number 7
    python -m tests.mutants --timeout 120

The first list (issue #44) is the behaviours of the extent pool, compaction, the prefix cache and
the priority scheduler that an earlier pass found no test guarding.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutant:
    """Replace `old` (exactly one occurrence) by `new` in `path`; `tests` must then fail."""

    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]


POOL, STORE = "batchkv/cache/pool.py", "batchkv/cache/store.py"
PREFIX, SCHED = "batchkv/executor/prefix.py", "batchkv/executor/scheduler.py"
PLACEMENT, COMPACTION = "tests/test_pool_placement.py", "tests/test_store_compaction.py"
POLICY, ADMISSION = "tests/test_prefix_policy.py", "tests/test_admission_rows.py"
FAIRNESS = "tests/test_priority_fairness.py"

MUTANTS: list[Mutant] = [
    Mutant("store: chunked overlapping move copies from the wrong end", STORE,
           "for off in offsets if move.dst < move.src else reversed(offsets):",
           "for off in offsets if move.dst > move.src else reversed(offsets):", (COMPACTION,)),
    Mutant("prefix: match ignores the RoPE offset", PREFIX,
           "if history.rope_offset == offset:", "if True:", (POLICY,)),
    Mutant("prefix: an adopted tall history counts whole against n samples' rows", PREFIX,
           "rows - min(held, rows // max(columns, 1))", "rows - held", (ADMISSION,)),
    Mutant("scheduler: free_rows forgets the rows held back for forks", SCHED,
           "return self.cache.free_rows - sum(r.spare * self.reach(r) for r in self.prefilling)",
           "return self.cache.free_rows", (ADMISSION,)),
    Mutant("pool: release does not return the rows as a hole", POOL,
           "base, rows = self.extents.pop(key)\n        self._add_hole(base, rows)",
           "base, rows = self.extents.pop(key)", (PLACEMENT,)),
    Mutant("pool: a freed range does not merge with the hole after it", POOL,
           "if i < len(self._holes) and self._holes[i][0] == base + rows:",
           "if False:", (PLACEMENT,)),
    Mutant("store: an extent that moved to grow keeps its old rows", STORE,
           "            pool.release(key)\n            pool.extents[key] = pool.extents.pop(moving)",
           "            pool.extents[key] = pool.extents.pop(moving)", (PLACEMENT,)),
    Mutant("pool: best-fit ties go to the highest address", POOL,
           "size < self._holes[best][1]", "size <= self._holes[best][1]", (PLACEMENT,)),
    Mutant("prefix: a one-block history is not kept", PREFIX,
           "if written < BLOCK:", "if written <= BLOCK:", (POLICY,)),
    Mutant("prefix: eviction counts a row per history, not its reach", PREFIX,
           "freed_rows += self.cache.reach(history.seq)", "freed_rows += 1", (POLICY,)),
    Mutant("prefix: reuse does not make a history the most recently used", PREFIX,
           "            del self.cached[history]\n            self.cached[history] = None\n            history.used",
           "            history.used", (POLICY,)),
    Mutant("prefix: ties prefer a live history over an equal cached one", PREFIX,
           "(n == best_len and n and history.live is None)",
           "(n == best_len and n and history.live is not None)", (POLICY,)),
    Mutant("prefix: lookup does not index tokens read after retirement", PREFIX,
           "if history.matchable() // BLOCK > len(history.blocks):", "if False:", (POLICY,)),
    Mutant("scheduler: a request waiting for a donor blocks those behind it", SCHED,
           "if match.wait:\n                continue", "if match.wait:\n                return", (FAIRNESS,)),
    Mutant("scheduler: less urgent prompts prefill while urgent requests run", SCHED,
           "prefilling = [state for state in self.prefilling if state.request.priority == level]",
           "prefilling = self.prefilling", (FAIRNESS,)),
    Mutant("scheduler: no round-robin among urgent samples", SCHED,
           "self.running = deque([s for s in self.running if s not in picked] + taken)",
           "self.running = deque(self.running)", (FAIRNESS,)),
    Mutant("scheduler: urgent prompts held to the prefill budget beside only paused samples", SCHED,
           "prefill_cap = self.prefill_budget if running else budget",
           "prefill_cap = self.prefill_budget if self.running else budget", (FAIRNESS,)),
]  # fmt: skip


def copy_tree(dest: Path) -> Path:
    """The repository without git, caches or build outputs, at dest / 'tree'."""
    ignore = shutil.ignore_patterns(".git", "__pycache__", ".pytest_cache", ".ruff_cache", "*.egg-info", ".venv")
    return Path(shutil.copytree(ROOT, dest / "tree", ignore=ignore))


def pytest(tree: Path, tests: tuple[str, ...], timeout: float) -> tuple[str, float, str]:
    """Run `tests` in `tree`: ('pass' | 'fail' | 'timeout' | 'error', seconds, output tail)."""
    # No bytecode: a mutant of the same size written within a second of the original would
    # otherwise be run from the original's cached .pyc.
    env = os.environ | {"PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-p", "no:randomly", *tests]
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", time.perf_counter() - start, ""
    seconds, tail = time.perf_counter() - start, (done.stdout + done.stderr)[-2000:]
    # pytest: 0 passed, 1 tests failed; 2-5 interrupted, internal or usage error, nothing collected
    return {0: "pass", 1: "fail"}.get(done.returncode, "error"), seconds, tail


def check(mutants: list[tuple[int, Mutant]], timeout: float) -> int:
    """Run the check; prints a table and returns how many mutants were not caught."""
    with tempfile.TemporaryDirectory(prefix="batchkv-mutants-") as tmp:
        tree = copy_tree(Path(tmp))
        probe = subprocess.run([sys.executable, "-c", "import batchkv; print(batchkv.__file__)"], cwd=tree,
                               env=os.environ | {"PYTHONPATH": str(tree)}, capture_output=True, text=True)  # fmt: skip
        assert probe.stdout.startswith(str(tree)), f"batchkv imports from {probe.stdout or probe.stderr}, not the copy"
        selections = tuple(dict.fromkeys(test for _, m in mutants for test in m.tests))
        status, seconds, tail = pytest(tree, selections, timeout * 2)
        if status != "pass":
            print(f"the selections fail on the unchanged code ({status}, {seconds:.0f} s):\n{tail}")
            return len(mutants)
        print(f"unchanged code: {len(selections)} selections pass ({seconds:.0f} s)\n")
        rows = []
        for number, mutant in mutants:
            path = tree / mutant.path
            original = path.read_text()
            found = original.count(mutant.old)
            if found != 1:
                rows.append((number, mutant, f"stale ({found} matches)", 0.0))
                continue
            path.write_text(original.replace(mutant.old, mutant.new))
            try:
                status, seconds, _ = pytest(tree, mutant.tests, timeout)
            finally:
                path.write_text(original)
            verdict = {"fail": "caught", "timeout": "caught (timeout)", "pass": "MISSED"}.get(status, "error")
            rows.append((number, mutant, verdict, seconds))
            print(f"{number:>2}  {verdict:<16} {seconds:5.0f} s  {mutant.name}", flush=True)
    caught = sum(verdict.startswith("caught") for _, _, verdict, _ in rows)
    print(f"\n{caught}/{len(rows)} caught\n")
    print("| # | file | mutation | caught by | result |\n|---|---|---|---|---|")
    for number, mutant, verdict, _ in rows:
        tests = ", ".join(Path(t.split("::")[0]).name for t in mutant.tests)
        print(f"| {number} | {Path(mutant.path).name} | {mutant.name} | {tests} | {verdict} |")
    return len(rows) - caught


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("select", nargs="*", help="mutant numbers, or words their names contain (default: all)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per mutant's selection (default 300)")
    args = parser.parse_args(argv)
    chosen = [
        (number, m)
        for number, m in enumerate(MUTANTS, 1)
        if not args.select or any(s == str(number) or s.lower() in m.name.lower() for s in args.select)
    ]
    return 1 if check(chosen, args.timeout) else 0


if __name__ == "__main__":
    sys.exit(main())
