"""transformers' own continuous batching as the serving peer of bench/decode.py, configured at its best.

The peer is `model.init_continuous_batching(...)`: paged KV, its scheduler, its CUDA graphs and
compile options, its generation loop in a background thread. A client in the calling thread
submits requests (all at once for an offline run, at their arrival times for an online run) with
at most `max_inflight` in flight, streams tokens back, and time-boxes the run: past the box the
manager is hard-stopped and the record says how far it got.

Candidates are the settings a user can turn (`ContinuousBatchingConfig`: CUDA graphs, compile
level, batch-token budget; the attention implementations installed: flash attention only when
its package is importable, else paged SDPA and paged eager); `calibrate` runs each on a few
requests within a budget and ranks them by output tokens/s. Works with transformers 5.17 (the
KV block field is `block_size`) through 5.24 (`page_size`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Sequence

import torch

from .online import latency_summary
from .timing import Deadline


def candidates() -> list[dict]:
    """Settings to calibrate, in order of promise: attention, CUDA graphs, batch tokens, compile level."""
    from transformers.utils import is_flash_attn_2_available

    found = [{"attn": "sdpa", "graphs": False, "batch_tokens": 1024, "compile": 0}]  # its default for SDPA
    found += [
        {"attn": "sdpa", "graphs": True, "batch_tokens": 1024, "compile": 0},
        {"attn": "sdpa", "graphs": False, "batch_tokens": 2048, "compile": 0},
        {"attn": "sdpa", "graphs": False, "batch_tokens": 512, "compile": 0},
        {"attn": "sdpa", "graphs": True, "batch_tokens": 2048, "compile": 0},
        {"attn": "eager", "graphs": False, "batch_tokens": 1024, "compile": 0},
        {"attn": "sdpa", "graphs": True, "batch_tokens": 1024, "compile": 1},  # torch.compile under its graphs
    ]
    if is_flash_attn_2_available():  # paged flash attention and its block-table decode path
        found.insert(0, {"attn": "flash_attention_2", "graphs": True, "batch_tokens": 1024, "compile": 0})
    return found


def cb_config(setting: dict, max_len: int, max_inflight: int, block: int = 256):
    """A ContinuousBatchingConfig for `setting`, sized like batchkv's cache: max_inflight sequences of max_len."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    blocks = max_inflight * (math.ceil(max_len / block) + 1)
    wanted = {
        "num_blocks": blocks,
        "max_batch_tokens": setting["batch_tokens"],
        "max_requests_per_batch": max_inflight,
        "use_cuda_graph": setting["graphs"] and torch.cuda.is_available(),
        "default_compile_level": setting["compile"],
        "allow_block_sharing": False,  # random prompts share no prefix
        ("page_size" if "page_size" in fields else "block_size"): block,
    }
    return ContinuousBatchingConfig(**{k: v for k, v in wanted.items() if k in fields})


def _generation_config(max_new: int):
    from transformers import GenerationConfig

    return GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=-1, pad_token_id=0)


def serve(
    model,
    setting: dict,
    prompts: Sequence[Sequence[int]],
    outputs: Sequence[int],
    arrivals: Sequence[float] | None = None,
    *,
    max_inflight: int = 64,
    box_s: float = 60.0,
    return_tokens: bool = False,
) -> dict:
    """Serve the requests through transformers continuous batching; tokens/s and latencies.

    arrivals: seconds from the start at which each request arrives (None: all at once, offline).
    box_s: seconds the run may go on past the last arrival before the manager is hard-stopped.
    Times to first token count from the arrival; token times are the peer's own per-token
    timestamps (taken in its generation thread). Setup (cache, warm-up captures, compiles) is not
    timed. Returns tokens, tokens/s over the wall time to the last token, finished requests,
    whether the box cut the run short, and the latency percentiles (and, with return_tokens, each
    request's generated ids in request order under "token_ids").
    """
    n = len(prompts)
    arrivals = list(arrivals) if arrivals is not None else [0.0] * n
    max_len = max(len(p) + o for p, o in zip(prompts, outputs, strict=True))
    model.set_attn_implementation(setting["attn"])
    setup = time.perf_counter()
    manager = model.init_continuous_batching(
        generation_config=_generation_config(max(outputs)),
        continuous_batching_config=cb_config(setting, max_len, max_inflight),
    )
    if hasattr(manager, "warmup"):
        manager.warmup()
    manager.start()
    setup_s = time.perf_counter() - setup
    latest: dict[str, object] = {}  # request id -> its latest streamed output
    arrived: dict[str, float] = {}
    nxt, inflight, boxed = 0, 0, False
    start = time.perf_counter()
    try:
        while nxt < n or inflight:
            now = time.perf_counter()
            if now - start > arrivals[-1] + box_s:
                boxed = True
                break
            while nxt < n and inflight < max_inflight and start + arrivals[nxt] <= now:
                rid = f"r{nxt}"
                manager.add_request(prompts[nxt], request_id=rid, max_new_tokens=outputs[nxt], streaming=True,
                                    record_timestamps=True, eos_token_id=-1)  # fmt: skip
                arrived[rid] = start + arrivals[nxt]
                nxt, inflight = nxt + 1, inflight + 1
            result = manager.get_result(timeout=0.005)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("the generation thread stopped with requests in flight")
                continue
            if result.error:
                raise RuntimeError(f"request {result.request_id} failed: {result.error}")
            latest[result.request_id] = result
            if result.is_finished():
                inflight -= 1
    finally:
        manager.stop(block=True, timeout=30, hard_stop=boxed)
        if hasattr(manager, "destroy"):
            manager.destroy()
    summary = _summary(latest, arrived, start, n, boxed, setup_s, box_s)
    if return_tokens:
        summary["token_ids"] = [list(latest[f"r{i}"].generated_tokens) if f"r{i}" in latest else [] for i in range(n)]
    return summary


def _summary(latest: dict, arrived: dict, start: float, n: int, boxed: bool, setup_s: float, box_s: float) -> dict:
    first, gaps, stamps, tokens, finished = [], [], [], 0, 0
    for rid, out in latest.items():
        times = list(out.timestamps or [])
        tokens += len(out.generated_tokens)
        finished += bool(out.is_finished())
        if times:
            first.append(times[0] - arrived[rid])
            gaps += [b - a for a, b in itertools.pairwise(times)]
            stamps.append(times[-1])
    wall = max(stamps) - start if stamps else 0.0
    return {
        "requests": n,
        "submitted": len(arrived),
        "finished": finished,
        "tokens": tokens,
        "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "wall_s": wall,
        "boxed": boxed,
        "box_s": box_s,
        "setup_s": setup_s,
        "no_first_token": len(arrived) - len(first),
        **latency_summary(first, gaps),
    }


COMPILE_S = 150.0  # budget a compile candidate needs: compiling the 8B forward takes minutes


def calibrate(
    model, prompts, outputs, budget_s: float, cap: int = 32, box_s: float = 20.0, settings: list | None = None
) -> tuple[dict | None, list]:
    """Each candidate (or each of `settings`) on `prompts` (outputs capped at `cap`) while `budget_s`
    lasts; (fastest, all tried). A compile candidate starts only with COMPILE_S left (its compile
    cannot be interrupted)."""
    deadline, tried = Deadline(budget_s), []
    capped = [min(o, cap) for o in outputs]
    for setting in candidates() if settings is None else settings:
        need = COMPILE_S if setting["compile"] else 5.0
        if deadline.left() < need:
            tried.append(
                {"setting": setting, "skipped": f"calibration budget: {deadline.left():.0f} s left, needs {need:.0f}"}
            )
            continue
        row: dict = {"setting": setting}
        tried.append(row)
        try:
            run = serve(model, setting, prompts, capped, box_s=min(box_s, deadline.left()))
            row.update(tokens_per_s=run["tokens_per_s"], setup_s=run["setup_s"], boxed=run["boxed"])
        except Exception as exc:  # a setting this install cannot run is recorded, not fatal
            row["failed"] = f"{type(exc).__name__}: {exc}"[:300]
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        print(f"hf_cb calibrate {setting}: {row.get('tokens_per_s', row.get('failed'))}", flush=True)
    return fastest(tried), tried


def fastest(tried: list[dict]) -> dict | None:
    """The setting of the calibration row with the most tokens/s (None when no row ran)."""
    ok = [r for r in tried if r.get("tokens_per_s")]
    return max(ok, key=lambda r: r["tokens_per_s"])["setting"] if ok else None


def prefix_fitting(outputs: Sequence[int], tokens_per_s: float, box_s: float, least: int = 8) -> int:
    """Leading requests whose outputs a peer at `tokens_per_s` generates in 80% of `box_s` (at least `least`)."""
    budget, total = 0.8 * box_s * tokens_per_s, 0
    for i, o in enumerate(outputs):
        total += o
        if total > budget:
            return max(least, i)
    return len(outputs)
