"""The interpreter's switch interval while engine threads run: one value per process, so counted.

CPython has one switch interval per process. Each running `EngineWorker` holds a `ShortSwitch`: the
first one held sets the short interval and remembers the one it found, the last one released puts
that back. Workers whose lifetimes overlap, stopped in any order, leave the interpreter as they
found it; `release` is idempotent and thread-safe (the engine thread and `stop` may both call it).
"""

from __future__ import annotations

import sys
import threading

_LOCK = threading.Lock()
_STATE: dict = {"held": set(), "found": None}  # the ShortSwitch objects held; the interval before the first


class ShortSwitch:
    """`sys.setswitchinterval(interval)` while held by at least one holder (process-wide)."""

    def __init__(self, interval: float) -> None:
        self.interval = interval

    def hold(self) -> None:
        """Take part (no-op when this one holds already); the first holder sets the interval."""
        with _LOCK:
            held = _STATE["held"]
            if self in held:
                return
            if not held:
                _STATE["found"] = sys.getswitchinterval()
                sys.setswitchinterval(self.interval)
            held.add(self)

    def release(self) -> None:
        """Stop taking part (no-op when not held); the last holder restores the interval found."""
        with _LOCK:
            held = _STATE["held"]
            if self not in held:
                return
            held.discard(self)
            if not held:
                sys.setswitchinterval(_STATE["found"])
