"""Mutation check: small changes to the code, each of which some named tests must catch.

Each `Mutant` replaces one exact piece of text in one file (it must occur exactly once) and names
the test that must then fail. The check copies the repository to a temporary directory once, runs
every named test there unchanged (they must pass), then applies each mutant alone, runs its test
with a time limit and puts the file back. Nothing in the working tree
is touched. Not collected by pytest and not run by CI: run it by hand after changing the code it
covers (a mutant whose text is gone is reported `stale`: re-locate it, do not drop it).

    python -m tests.mutants                 # every mutant of both lists
    python -m tests.mutants pool 44.7       # mutants whose name contains "pool", and number 7 of list 44
    python -m tests.mutants --list 38 3 5   # numbers 3 and 5 of the second list
    python -m tests.mutants --timeout 120

The first list (issue #44) is the behaviours of the extent pool, compaction, the prefix cache and
the priority scheduler that an earlier pass found no test guarding. The second (issue #38) is a
fresh pass over the vectorised host path: the cache's per-sequence arrays, the pool's extent
mirror, the step plan and buffer fill, and the scheduler and engine's slot arrays.
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
ADMIT = "batchkv/executor/admission.py"  # the Scheduler's admission half
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
    Mutant("scheduler: free_rows forgets the rows held back for forks", ADMIT,
           "return self.cache.free_rows - sum(r.spare * self.horizon(r) for r in self.forking)",
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
    Mutant("scheduler: a request waiting for a donor blocks those behind it", ADMIT,
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

# The second list (issue #38's vectorised host path): the cache's per-sequence arrays, the pool's
# extent mirror, the step plan's run-length encoding and buffer fill, the staged upload's spans,
# the reference attention's live rows and the static-bytes check; then the scheduler and engine's
# slot arrays. Most are caught by the property test that drives the cache and the per-sequence
# loops it replaced (`LoopCache`) through the same random traces.
BATCH, STEP, STAGING = "batchkv/cache/batch.py", "batchkv/cache/step.py", "batchkv/cache/staging.py"
REFERENCE, FOOTPRINT = "batchkv/ops/reference.py", "batchkv/cache/footprint.py"
HOOKS = "batchkv/cache/hooks.py"
SLOTS, METRICS, RECORD = "batchkv/executor/slots.py", "batchkv/executor/metrics.py", "batchkv/executor/record.py"
SLOTS_TEST, TABLE = "tests/test_scheduler_arrays.py", "tests/test_slot_table.py"
SLOTS_MODEL = "test_slot_arrays_plan_and_record_what_the_per_sample_model_does"
ARRAYS, LIVE, CACHE = "tests/test_cache_arrays.py", "tests/test_cache_live.py", "tests/test_cache.py"
LOOPS = "test_array_bookkeeping_stages_and_refuses_exactly_as_the_per_sequence_loops"
FIXED_POOL = "test_array_bookkeeping_matches_the_loops_in_a_fixed_pool_where_extents_move_and_compact"
SPLIT = "test_a_split_declaration_continues_each_sequence_run_after_run"

VECTORISED: list[Mutant] = [
    Mutant("batch: seq_rm does not push the freed id back on the heap", BATCH,
           "heapq.heappush(self._released, seq)",
           "pass",
           ARRAYS, LOOPS),
    Mutant("hooks: a loaded history keeps the high-water mark of the one it replaced", HOOKS,
           "self._hw[seq] = n  # every resident row now holds the new history",
           "pass",
           "tests/test_cache_hooks.py", "test_loading_over_a_longer_history_replaces_it"),
    Mutant("batch: a clone's high-water mark is its length, not what the donor wrote", BATCH,
           "self._hold(dst, int(upto), int(self._hw[src]), height)",
           "self._hold(dst, int(upto), int(upto), height)",
           CACHE, "test_a_fork_of_a_fork_keeps_the_donors_floor"),
    Mutant("batch: seq_rm drops a declaration that does not name it", BATCH,
           "if self._declaration is not None and self._declared[seq]:\n            self._drop_declaration()",
           "if self._declaration is not None:\n            self._drop_declaration()",
           ARRAYS, LOOPS),
    Mutant("batch: rewind keeps a prepared step's stale positions", BATCH,
           "self._len[seq] = int(new_len)\n        self._restage(seq)",
           "self._len[seq] = int(new_len)",
           ARRAYS, LOOPS),
    Mutant("batch: the first unknown id refused is the last in packed order", BATCH,
           "self._known(members[np.argmin(known)].item())",
           "self._known(members[~known][-1].item())",
           ARRAYS, LOOPS),
    Mutant("batch: an id equal to max_seqs passes the range mask", BATCH,
           "(members < cfg.max_seqs)",
           "(members <= cfg.max_seqs)",
           ARRAYS, LOOPS),
    Mutant("batch: a step ending exactly at its extent's height grows it", BATCH,
           "short = ends > self._height[decl.members]",
           "short = ends >= self._height[decl.members]",
           ARRAYS, LOOPS),
    Mutant("batch: prepare_step lowers the high-water mark after a rewind", BATCH,
           "np.maximum(self._hw[members], self._len[members] + decl.counts)",
           "self._len[members] + decl.counts",
           ARRAYS, LOOPS),
    Mutant("batch: commit adds per segment through a fancy index (a split sequence advances once)", BATCH,
           "self._len[self._declaration.members] += self._declaration.counts",
           "self._len[self._declaration.seqs] += self._declaration.q_len",
           ARRAYS, LOOPS),
    Mutant("batch: the ring floor follows the largest ring, not the smallest", BATCH,
           "self._min_ring = min(rings, default=0)",
           "self._min_ring = max(rings, default=0)",
           ARRAYS, "test_a_sequence_past_the_smaller_of_two_rings_has_the_ring_floor_of_the_per_layer_loop"),
    Mutant("step: the first refused writer is the first over max_write, not over either limit", STEP,
           "i = int(np.argmax(over | beyond))",
           "i = int(np.argmax(over))",
           ARRAYS, "test_a_step_refuses_its_first_sequence_over_either_limit_in_packed_order_as_the_loop_does"),
    Mutant("step: a step ending exactly at capacity is refused", STEP,
           "over, beyond = counts > max_write, ends > capacity",
           "over, beyond = counts > max_write, ends >= capacity",
           "tests/test_boundaries.py", "test_a_sequence_reaches_exactly_its_capacity_and_not_one_more"),
    Mutant("step: the exclusive cumsum of run lengths starts at the first run's length", STEP,
           "before = np.cumsum(sorted_len) - sorted_len",
           "before = np.cumsum(sorted_len)",
           ARRAYS, SPLIT),
    Mutant("step: the one-run fast path compares neighbouring runs, not sorted ids", STEP,
           "if not (ordered[1:] == ordered[:-1]).any():",
           "if not (seqs[1:] == seqs[:-1]).any():",
           ARRAYS, SPLIT),
    Mutant("step: a sequence's first run is not carried to its later runs", STEP,
           "np.maximum.accumulate(np.where(first, np.arange(len(seqs)), 0))",
           "np.where(first, np.arange(len(seqs)), 0)",
           ARRAYS, SPLIT),
    Mutant("step: members come in id order, not order of first appearance", STEP,
           "order = np.argsort(heads, kind=\"stable\")",
           "order = np.arange(len(heads))",
           ARRAYS, SPLIT),
    Mutant("step: a second run's kv_end ignores the tokens of the first", STEP,
           "return lengths[self.seqs] + self.consumed + self.q_len",
           "return lengths[self.seqs] + self.q_len",
           ARRAYS, SPLIT),
    Mutant("step: seq_info rows the previous step used are not zeroed", STEP,
           "if stale > count:\n            info[:, count:stale] = 0",
           "if False:\n            info[:, count:stale] = 0",
           ARRAYS, LOOPS),
    Mutant("step: the zeroed seq_info rows are not uploaded", STEP,
           "4 * max(count, stale)",
           "4 * count",
           ARRAYS, LOOPS),
    Mutant("step: a group's slots are uploaded from the span one group lower", STEP,
           "(w * (1 + g), w * (1 + g) + width)",
           "(w * g, w * g + width)",
           ARRAYS, LOOPS),
    Mutant("pool: the extent mirror skips sequence id 0", POOL,
           "if type(key) is int and 0 <= key < self.slots:\n            self.bases[key], self.sizes[key] = base, rows",
           "if type(key) is int and 0 < key < self.slots:\n            self.bases[key], self.sizes[key] = base, rows",
           ARRAYS, LOOPS),
    Mutant("pool: a compaction's new bases bypass the extent mirror", POOL,
           "self._set(move.key, move.dst, move.rows)",
           "self.extents[move.key] = (move.dst, move.rows)",
           ARRAYS, FIXED_POOL),
    Mutant("reference: the attention skips one-token segments with the empty rows", REFERENCE,
           "seq_info[seq_info[:, 1] > 0]",
           "seq_info[seq_info[:, 1] > 1]",
           LIVE, "test_the_reference_attention_visits_only_the_rows_with_queries"),
    Mutant("footprint: the extent mirrors' bytes count one layer group, whatever the layers", FOOTPRINT,
           "per_sequence = 2 + 3 * 8 + groups * 2 * 8",
           "per_sequence = 2 + 3 * 8 + 2 * 8",
           LIVE, "test_static_bytes_are_what_a_built_cache_holds_in_its_per_sequence_arrays_and_step_buffers"),
    # the scheduler and engine's slot arrays (executor/slots.py, scheduler.py, record.py, metrics.py)
    Mutant("scheduler: the most urgent level ignores the least urgent running sample", SCHED,
           "priorities.update((int(levels.min()), int(levels.max())))",
           "priorities.update((int(levels.min()),))",
           "tests/test_executor_priority.py", "test_a_less_urgent_request_pauses_while_a_more_urgent_one_is_admitted"),
    Mutant("scheduler: running samples of a less urgent level are not paused", SCHED,
           "return prefilling, running[levels == level]",
           "return prefilling, running",
           SLOTS_TEST, SLOTS_MODEL),
    Mutant("scheduler: the samples a step deferred do not go first next step", SCHED,
           "self._running = np.concatenate((running[take:], taken))",
           "self._running = running",
           SLOTS_TEST, SLOTS_MODEL),
    Mutant("scheduler: a decode row's RoPE t leaves out its pending token", SCHED,
           "(table.t0[taken] + table.read[taken] + pending)",
           "(table.t0[taken] + table.read[taken])",
           SLOTS_TEST, SLOTS_MODEL),
    Mutant("scheduler: rows with their token on the host also gather one from the device", SCHED,
           "np.where(waits, table.src[taken], -1).tolist()",
           "table.src[taken].tolist()",
           SLOTS_TEST, SLOTS_MODEL),
    Mutant("scheduler: a pending token's source is its logits row, not its sampling row", SCHED,
           "table.src[slots] = np.arange(len(slots))",
           "table.src[slots] = np.asarray(batch.rows)",
           SLOTS_TEST, SLOTS_MODEL),
    Mutant("scheduler: a sample that cannot be fed again keeps its column one step longer", SCHED,
           "table.read[slots] + table.pending[slots] >= table.limit[slots]",
           "table.read[slots] + table.pending[slots] > table.limit[slots]",
           SLOTS_TEST, SLOTS_MODEL),
    Mutant("record: a stop id must match in every stop column (wrong reduction)", RECORD,
           "(table.stops[slots] == token[:, None]).any(axis=1)",
           "(table.stops[slots] == token[:, None]).all(axis=1)",
           SLOTS_TEST, SLOTS_MODEL),
    Mutant("record: a token read for a sample cancelled since launch is recorded", RECORD,
           "keep = ~table.done[slots]",
           "keep = np.ones(len(slots), dtype=bool)",
           SLOTS_TEST, SLOTS_MODEL),
    Mutant("record: max_new_tokens is reached one token late", RECORD,
           "length = read >= table.max_new[slots]",
           "length = read > table.max_new[slots]",
           SLOTS_TEST, SLOTS_MODEL),
    Mutant("record: a stop token that is also the last allowed finishes by length", RECORD,
           "np.where(stop, 1, np.where(length, 2, 3))",
           "np.where(length, 2, np.where(stop, 1, 3))",
           SLOTS_TEST, SLOTS_MODEL),
    Mutant("scheduler: finished samples stay in the running slots", SCHED,
           "if finished:\n            self._running = self._running[~self.table.done[self._running]]\n",
           "if finished:\n",
           SLOTS_TEST, SLOTS_MODEL),
    Mutant("scheduler: a retired sample's slot is freed while a launched step still names it", SCHED,
           "if sample.pending:\n                keep.append(sample)",
           "if False:\n                keep.append(sample)",
           SLOTS_TEST, SLOTS_MODEL),
    Mutant("slots: a table that grows drops the stop ids of the slots it had", SLOTS,
           "stops[:old] = self.stops",
           "pass",
           TABLE, "test_a_table_grown_past_its_first_size_keeps_the_stop_ids_of_its_first_samples"),
    Mutant("metrics: a sample's first token counts as an inter-token gap", METRICS,
           "later = arrived & (read > 0)",
           "later = arrived",
           "tests/test_executor.py", "test_time_to_first_token_counts_each_request_once_whatever_its_samples"),
]  # fmt: skip

LISTS = {"44": MUTANTS, "38": VECTORISED}


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


def check(mutants: list[tuple[str, Mutant]], timeout: float) -> int:
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
            print(f"{number:>5}  {verdict:<16} {seconds:5.0f} s  {mutant.name}", flush=True)
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
    lists = "44: the first pass's behaviours; 38: the vectorised host path's (default: both)"
    parser.add_argument("--list", choices=[*LISTS, "all"], default="all", help=lists)
    args = parser.parse_args(argv)
    lists = LISTS if args.list == "all" else {args.list: LISTS[args.list]}
    chosen = [
        (f"{name}.{number}", m)
        for name, mutants in lists.items()
        for number, m in enumerate(mutants, 1)
        if not args.select
        or any(s in (str(number), f"{name}.{number}") or s.lower() in m.name.lower() for s in args.select)
    ]
    return 1 if check(chosen, args.timeout) else 0


if __name__ == "__main__":
    sys.exit(main())
