"""What `batchkv run` shows and writes: a progress bar while it runs, a summary table at the end,
and the generated tokens of every request (`--output`)."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator
from typing import TextIO

from batchkv.cli.workload import ReplayResult, WorkItem


class ProgressBar:
    """One line on `stream` (stderr by default), redrawn in place at most 10 times a second.

    >>> bar = ProgressBar(total=24); bar.update(done=3, tokens=120); bar.close()
    """

    def __init__(self, total: int, stream: TextIO | None = None, *, enabled: bool = True, width: int = 28) -> None:
        self.total, self.stream, self.enabled, self.width = total, stream or sys.stderr, enabled, width
        self.start = time.perf_counter()
        self._last_draw = 0.0
        self._line = ""

    def update(self, done: int, tokens: int, *, force: bool = False) -> None:
        """Redraw with `done` of `total` finished and `tokens` generated so far."""
        if not self.enabled:
            return
        now = time.perf_counter()
        if not force and now - self._last_draw < 0.1:
            return
        self._last_draw = now
        elapsed = max(now - self.start, 1e-9)
        filled = int(self.width * done / self.total) if self.total else self.width
        bar = "#" * filled + "." * (self.width - filled)
        line = f"[{bar}] {done}/{self.total} done  {tokens} tokens  {tokens / elapsed:.1f} tok/s  {elapsed:.1f} s"
        self.stream.write("\r" + line.ljust(len(self._line)))
        self.stream.flush()
        self._line = line

    def close(self) -> None:
        """End the bar's line (the last drawn state stays visible)."""
        if self.enabled and self._line:
            self.stream.write("\n")
            self.stream.flush()


def summary_table(summary: dict, title: str, *, graphs: bool, sizing: str | None = None) -> str:
    """A two-column table of the headline numbers of `Metrics.summary()` (those bench/decode.py's
    serving part reports: tokens/s, inter-token and first-token p50/p99, step time, occupancy,
    graph captures); `sizing` is `Sizing.describe()` when the store was sized to the device."""
    finished = summary.get("finished", {})
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(finished.items()) if v)
    itl = "inter-token" if summary.get("itl_per", "token") == "token" else "per verify step"
    rows = [
        ("requests", f"{summary['requests_submitted']} submitted, {summary['requests_refused']} refused ({reasons})"),
        (
            "tokens",
            f"{summary['generated_tokens']} generated, {summary['prefill_tokens']} prompt, "
            f"{summary['padded_tokens']} padding",
        ),
        ("time", f"{summary['elapsed_s']:.2f} s over {summary['steps']} steps ({summary['step_ms_mean']:.2f} ms/step)"),
        ("tokens/s", f"{summary['tokens_per_s']:.1f} generated ({summary['processed_tokens_per_s']:.1f} processed)"),
        (f"{itl} p50", f"{summary['itl_ms_p50']:.2f} ms"),
        (f"{itl} p99", f"{summary['itl_ms_p99']:.2f} ms"),
        ("first token p50", f"{summary['ttft_ms_p50']:.1f} ms"),
        ("first token p99", f"{summary['ttft_ms_p99']:.1f} ms"),
        ("step time", "{step_ms_mean:.2f} ms mean, {step_ms_p50:.2f} p50, {step_ms_p99:.2f} p99".format(**summary)),
        ("occupancy", f"{100 * summary['occupancy']:.1f}% of columns held"),
        ("width buckets", f"{summary['width_buckets_used']} used"),
    ]
    if sizing is not None:
        rows.append(("store", sizing))
    if summary.get("prefix_reused_tokens") or summary.get("prefix_evictions"):
        rows.append(
            (
                "prefix cache",
                f"{100 * summary['prefix_hit_rate']:.0f}% of requests reused a prefix, "
                f"{summary['prefix_reused_tokens']} prompt tokens reused, {summary['prefix_evictions']} evicted",
            )
        )
    if summary.get("spec_proposed"):
        rows.append(
            (
                "speculative",
                f"{summary['spec_proposed']} drafts, {summary['spec_accepted']} accepted "
                f"({100 * summary['spec_acceptance_rate']:.0f}%); {summary['spec_accept_len_mean']:.2f} tokens "
                "per verify segment",
            )
        )
    if graphs:
        rows.append(
            ("graphs", f"{summary['captures']} captures, {summary['replays']} replays, {summary['growths']} growths")
        )
    else:
        rows.append(("graphs", f"off (eager); {summary['growths']} growths"))
    label = max(len(name) for name, _ in rows)
    lines = [title, "-" * len(title)] + [f"{name.ljust(label)}  {value}" for name, value in rows]
    return "\n".join(lines)


TOKENS_HELP = """\
tokens file (--output PATH): JSON Lines, one line per request and sample, in workload order
  {"request_id": 0, "sample": 0, "tokens": [17, 4, 9], "finish_reason": "length"}
request_id is the request's index in the workload; finish_reason is stop | length | capacity,
null for a sample cut short by Ctrl-C, and "refused" (with "error") for a refused request. A model
with a tokenizer also writes "text": the tokens decoded (special tokens left out)."""


def token_lines(
    result: ReplayResult, items: list[WorkItem], decode: Callable[[list[int]], str] | None = None
) -> Iterator[str]:
    """What `batchkv run --output` writes: one JSON line per request and sample, in workload order.

    `{"request_id": i, "sample": s, "tokens": [...], "finish_reason": r}` where i is the request's
    index in the workload; r is stop | length | capacity | cancelled, null for a sample that had
    not finished when the run was interrupted, and "refused" (with "error", the message, and no
    tokens) for a request the engine refused. `decode` (a tokenizer's) adds each sample's "text".
    """
    refused = dict(result.refusals)
    for index, output in result.outputs(items):
        if index in refused:
            line = {"request_id": index, "sample": 0, "tokens": [], "finish_reason": "refused", "error": refused[index]}
            yield json.dumps(line, ensure_ascii=False)
            continue
        n = items[index].request.params.n
        tokens = output.tokens if output is not None else [[] for _ in range(n)]
        reasons = output.finish_reasons if output is not None else [None] * n
        for sample, (ids, reason) in enumerate(zip(tokens, reasons, strict=True)):
            line = {"request_id": index, "sample": sample, "tokens": ids, "finish_reason": reason}
            if decode is not None:
                line["text"] = decode(ids)
            yield json.dumps(line, ensure_ascii=False)
