"""What the serving entry points (bench/decode.py, prefix.py, real_model.py, tp.py) share: the request list, the serving
engine and its warm-up (the heap frozen after it), an offline run, one sequence's ms/token, the idle engine's full-chunk
step, and `Parts` (named parts under one deadline, the JSON saved after each, `--resume` skipping those done)."""

from __future__ import annotations

import gc
import json
import time
import traceback
from pathlib import Path

import numpy as np
import torch

from batchkv.executor import Engine, Request, SamplingParams
from batchkv.executor.graphs import freeze_heap

from .timing import Deadline


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def release(device: torch.device) -> None:
    """Give a closed engine's memory (its model's reference cycles too: unfrozen) back before the next sizes itself."""
    gc.unfreeze()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def workload(n: int, prompt: tuple[int, int], output: tuple[int, int], vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, vocab, rng.integers(prompt[0], prompt[1] + 1)).tolist() for _ in range(n)]
    return prompts, rng.integers(output[0], output[1] + 1, n).tolist()


def serving_engine(
    model,
    device,
    prompts,
    outputs,
    max_seqs: int | str = "auto",
    kv_dtype=None,
    tensor_parallel: int = 1,
    use_graphs: bool | None = None,
    max_step_tokens: int = 1024,
) -> Engine:
    """The serving configuration: 1024-token steps (or `max_step_tokens`), 512-token prompt chunks, capacity the longest
    request, the store allocated whole, graphs on CUDA. max_seqs "auto" (the README's): 256 sequences,
    the store sized to the device; an int: that many, each column at capacity (the configuration before)."""
    capacity = max(map(len, prompts)) + max(outputs) + 1
    kv_positions = "auto" if max_seqs == "auto" else max_seqs * capacity
    return Engine(model, tensor_parallel=tensor_parallel, max_seqs=max_seqs, capacity=capacity,
                  max_step_tokens=max_step_tokens, prefill_chunk=min(512, capacity),
                  use_graphs=device.type == "cuda" if use_graphs is None else use_graphs,
                  device=device, kv_positions=kv_positions, kv_dtype=kv_dtype)  # fmt: skip


WARM_UP = (
    "the first 64 prompts with at most 16 new tokens each, untimed, then Engine.warm_up() (every width's graph "
    "captured, kernels compiled), an empty prefix cache and the heap frozen (freeze_heap, as batchkv serve does)"
)


def warm_up(engine: Engine, device, prompts, outputs) -> None:
    """`WARM_UP`, then fresh metrics: a serving engine starts its timed work warm, as the peers' setup
    (model load, compilation, graph capture) is timed apart from their serving."""
    serve_offline(engine, device, prompts[:64], [min(o, 16) for o in outputs[:64]])
    engine.clear_prefix_cache()
    engine.warm_up()  # every width's graph, so that no timed step captures one
    freeze_heap()  # as batchkv serve's engine process does: no timed step walks the model in a full collection
    engine.metrics = engine.metrics.fresh()


def single(engine: Engine, device, prompt_len: int, new_tokens: int, vocab: int) -> dict:
    """ms/token of one greedy sequence on an idle `engine` (median inter-token latency of the second
    of two identical requests: the first warms up), and its tokens."""
    prompt = np.random.default_rng(0).integers(0, vocab, prompt_len).tolist()
    for _ in range(2):
        engine.metrics.inter_token.clear()
        engine.submit(Request(prompt, SamplingParams(max_new_tokens=new_tokens)))
        sync(device)
        start = time.perf_counter()
        tokens = [e.token for e in engine.run_until_done() if e.token is not None]
        sync(device)
        wall = time.perf_counter() - start
    itl = np.asarray(engine.metrics.inter_token) * 1e3
    return {"ms_per_token_p50": float(np.median(itl)), "ms_per_token_mean": float(itl.mean()), "wall_s": wall,
            "tokens": tokens, "captures": engine.metrics.captures}  # fmt: skip


def one_sequence(source, device, prompt_len: int, new_tokens: int, vocab: int, graphs: bool, tp: int = 1) -> dict:
    """`single` on an engine made for one sequence (bench/decode.py's b1 configuration), closed after."""
    length = prompt_len + new_tokens + 1
    engine = Engine(source, tensor_parallel=tp, max_seqs=1, capacity=length, max_step_tokens=prompt_len,
                    prefill_chunk=prompt_len, width_buckets=(1, prompt_len), use_graphs=graphs, device=device,
                    kv_positions=length)  # fmt: skip
    with engine:
        out = single(engine, device, prompt_len, new_tokens, vocab)
    release(device)
    return out


def full_chunk_step_ms(engine: Engine, device, prompts, repeats: int = 5) -> float:
    """The unit of the time-to-first-token target: the median time, on the idle warm engine, from
    submitting one prompt of exactly `prefill_chunk` tokens to its first token (one step)."""
    chunk = min(engine.scheduler.prefill_chunk, engine.cache.capacity - 1)  # room for the one token
    prompt = [t for p in prompts for t in p][:chunk]
    times = []
    for _ in range(repeats + 1):  # the first captures this width if the workload never used it
        sync(device)
        start = time.perf_counter()
        engine.submit(Request(prompt, SamplingParams(max_new_tokens=1)))
        engine.run_until_done()
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times[1:]))


def serve_offline(engine: Engine, device, prompts, outputs) -> dict:
    """Every request submitted at once, run to the end; the engine's summary and the wall time. The
    prefix cache starts empty: the requests reuse only one another's prefixes, not an earlier run's."""
    engine.clear_prefix_cache()
    for p, o in zip(prompts, outputs, strict=True):
        engine.submit(Request(p, SamplingParams(max_new_tokens=o)))
    sync(device)
    start = time.perf_counter()
    engine.run_until_done()
    sync(device)
    summary = engine.metrics.summary()
    summary["wall_s"] = wall = time.perf_counter() - start
    summary["output_tokens_per_s_wall"] = summary["generated_tokens"] / wall
    return summary


class Parts:
    """Runs named parts once each, under a deadline, saving the result after every part."""

    skip: tuple[str, ...] = ()  # parts not to run (--skip-parts)

    def __init__(self, result: dict, out: Path, deadline: Deadline) -> None:
        self.result, self.out, self.deadline = result, out, deadline
        self.status = result.setdefault("parts", {})

    def save(self) -> None:
        self.out.write_text(json.dumps(self.result, indent=2) + "\n")

    def run(self, name: str, fn, need_s: float = 1.0) -> None:
        if self.status.get(name, {}).get("status") == "done":
            return
        if name in self.skip:
            self.status[name] = {"status": "skipped: --skip-parts"}
            return
        left = self.deadline.left()
        if left < need_s:
            self.status[name] = {"status": f"skipped: {left:.0f} s of the budget left, needs about {need_s:.0f}"}
        else:
            start = time.perf_counter()
            try:
                fn()
                self.status[name] = {"status": "done"}
            except Exception as exc:  # a part that fails is recorded, and the others still run
                traceback.print_exc()
                self.status[name] = {"status": f"failed: {type(exc).__name__}: {exc}"[:500]}
            self.status[name]["s"] = round(time.perf_counter() - start, 1)
        print(f"== part {name}: {self.status[name]}", flush=True)
        self.save()
