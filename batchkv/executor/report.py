"""What `batchkv run` shows: a progress bar while it runs and a summary table at the end."""

from __future__ import annotations

import sys
import time
from typing import TextIO


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
    rows = [
        ("requests", f"{summary['requests_submitted']} submitted, {summary['requests_refused']} refused ({reasons})"),
        (
            "tokens",
            f"{summary['generated_tokens']} generated, {summary['prefill_tokens']} prompt, "
            f"{summary['padded_tokens']} padding",
        ),
        ("time", f"{summary['elapsed_s']:.2f} s over {summary['steps']} steps ({summary['step_ms_mean']:.2f} ms/step)"),
        ("tokens/s", f"{summary['tokens_per_s']:.1f} generated ({summary['processed_tokens_per_s']:.1f} processed)"),
        ("inter-token p50", f"{summary['itl_ms_p50']:.2f} ms"),
        ("inter-token p99", f"{summary['itl_ms_p99']:.2f} ms"),
        ("first token p50", f"{summary['ttft_ms_p50']:.1f} ms"),
        ("first token p99", f"{summary['ttft_ms_p99']:.1f} ms"),
        ("step time", "{step_ms_mean:.2f} ms mean, {step_ms_p50:.2f} p50, {step_ms_p99:.2f} p99".format(**summary)),
        ("occupancy", f"{100 * summary['occupancy']:.1f}% of columns held"),
        ("width buckets", f"{summary['width_buckets_used']} used"),
    ]
    if sizing is not None:
        rows.append(("store", sizing))
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
