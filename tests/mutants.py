"""Mutation check: small changes to the code, each of which some named tests must catch.

Each `Mutant` replaces one exact piece of text in one file (it must occur exactly once) and names
the test that must then fail. The check copies the repository to a temporary directory once, runs
every named test there unchanged (they must pass), then applies each mutant alone, runs its test
with a time limit and puts the file back. Nothing in the working tree
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
    """Replace `old` (exactly one occurrence) by `new` in `path`; test `test` of `file` must then fail."""

    name: str
    path: str
    old: str
    new: str
    file: str
    test: str

    @property
    def selection(self) -> str:
        return f"{self.file}::{self.test}"


POOL, STORE = "batchkv/cache/pool.py", "batchkv/cache/store.py"
PREFIX, SCHED = "batchkv/executor/prefix.py", "batchkv/executor/scheduler.py"
PLACEMENT, COMPACTION = "tests/test_pool_placement.py", "tests/test_store_compaction.py"
POLICY, ADMISSION = "tests/test_prefix_policy.py", "tests/test_admission_rows.py"
FAIRNESS = "tests/test_priority_fairness.py"

MUTANTS: list[Mutant] = [
    Mutant("store: chunked overlapping move copies from the wrong end", STORE,
           "for off in offsets if move.dst < move.src else reversed(offsets):",
           "for off in offsets if move.dst > move.src else reversed(offsets):",
           COMPACTION, "test_a_tall_extent_compacted_down_by_less_than_its_height_keeps_every_row"),
    Mutant("prefix: match ignores the RoPE offset", PREFIX,
           "if history.rope_offset == offset:",
           "if True:",
           POLICY, "test_a_prompt_at_another_rope_offset_reuses_nothing_and_one_at_the_same_offset_reuses_it"),
    Mutant("prefix: an adopted tall history counts whole against n samples' rows", PREFIX,
           "rows - min(held, rows // max(columns, 1))",
           "rows - held",
           ADMISSION, "test_an_n_sample_request_adopting_a_tall_history_waits_for_its_forks_rows_under_a_full_store"),
    Mutant("scheduler: free_rows forgets the rows held back for forks", SCHED,
           "return self.cache.free_rows - sum(r.spare * self.reach(r) for r in self.prefilling)",
           "return self.cache.free_rows",
           ADMISSION, "test_a_later_request_does_not_take_the_rows_held_back_for_a_prompts_forks"),
    Mutant("pool: release does not return the rows as a hole", POOL,
           "base, rows = self._pop(key)\n        self._add_hole(base, rows)",
           "base, rows = self._pop(key)",
           PLACEMENT, "test_a_released_extents_rows_are_where_the_next_extent_of_its_size_lands"),
    Mutant("pool: a freed range does not merge with the hole after it", POOL,
           "if i < len(self._holes) and self._holes[i][0] == base + rows:",
           "if False:",
           PLACEMENT, "test_a_released_extent_merges_with_the_holes_after_and_before_it"),
    Mutant("store: an extent that moved to grow keeps its old rows", STORE,
           "            pool.release(key)\n            pool.rename(moving, key)",
           "            pool._pop(key)\n            pool.rename(moving, key)",
           PLACEMENT, "test_an_extent_that_moved_to_grow_leaves_its_old_rows_to_the_next_extent"),
    Mutant("pool: best-fit ties go to the highest address", POOL,
           "size < self._holes[best][1]",
           "size <= self._holes[best][1]",
           PLACEMENT, "test_equal_holes_give_an_extent_the_lowest_address"),
    Mutant("prefix: a one-block history is not kept", PREFIX,
           "if written < BLOCK:",
           "if written <= BLOCK:",
           POLICY, "test_a_finished_history_of_one_block_is_kept_and_one_shorter_is_not"),
    Mutant("prefix: eviction counts a row per history, not its reach", PREFIX,
           "freed_rows += self.cache.reach(history.seq)",
           "freed_rows += 1",
           POLICY, "test_eviction_frees_least_recently_used_histories_until_their_reach_covers_the_rows_needed"),
    Mutant("prefix: reuse does not make a history the most recently used", PREFIX,
           "            del self.cached[history]\n            self.cached[history] = None\n            history.used",
           "            history.used",
           POLICY, "test_a_reused_history_becomes_the_most_recently_used_and_is_evicted_last"),
    Mutant("prefix: ties prefer a live history over an equal cached one", PREFIX,
           "(n == best_len and n and history.live is None)",
           "(n == best_len and n and history.live is not None)",
           POLICY, "test_a_tie_between_a_cached_history_and_a_live_prompt_adopts_the_cached_one"),
    Mutant("prefix: lookup does not index tokens read after retirement", PREFIX,
           "if history.matchable() // BLOCK > len(history.blocks):",
           "if False:",
           POLICY, "test_tokens_read_after_a_history_was_retired_are_matched"),
    Mutant("scheduler: a request waiting for a donor blocks those behind it", SCHED,
           "if match.wait:\n                continue",
           "if match.wait:\n                return",
           FAIRNESS, "test_a_request_waiting_for_a_donors_prefix_lets_the_requests_behind_it_in"),
    Mutant("scheduler: less urgent prompts prefill while urgent requests run", SCHED,
           "prefilling = [state for state in self.prefilling if state.request.priority == level]",
           "prefilling = self.prefilling",
           FAIRNESS, "test_a_less_urgent_prompt_is_not_prefilled_while_urgent_samples_run"),
    Mutant("scheduler: no round-robin among urgent samples", SCHED,
           "self._running = np.concatenate((self._running[~picked], taken))",
           "self._running = self._running",
           FAIRNESS, "test_urgent_samples_a_step_cannot_all_take_take_turns_while_a_less_urgent_one_is_paused"),
    Mutant("scheduler: urgent prompts held to the prefill budget beside only paused samples", SCHED,
           "prefill_cap = self.prefill_budget if len(running) else budget",
           "prefill_cap = self.prefill_budget if len(self._running) else budget",
           FAIRNESS, "test_an_urgent_prompt_beside_only_paused_samples_takes_the_whole_step_not_the_prefill_budget"),
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
        selections = tuple(dict.fromkeys(m.selection for _, m in mutants))
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
                status, seconds, _ = pytest(tree, (mutant.selection,), timeout)
            finally:
                path.write_text(original)
            verdict = {"fail": "caught", "timeout": "caught (timeout)", "pass": "MISSED"}.get(status, "error")
            rows.append((number, mutant, verdict, seconds))
            print(f"{number:>2}  {verdict:<16} {seconds:5.0f} s  {mutant.name}", flush=True)
    caught = sum(verdict.startswith("caught") for _, _, verdict, _ in rows)
    print(f"\n{caught}/{len(rows)} caught\n")
    print("| # | file | mutation | caught by | result |\n|---|---|---|---|---|")
    for number, mutant, verdict, _ in rows:
        print(f"| {number} | {Path(mutant.path).name} | {mutant.name} | {mutant.test} | {verdict} |")
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
