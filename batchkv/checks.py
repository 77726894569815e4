"""Argument checks at the public boundary, and failed allocations as refusals.

Every public constructor and verb that takes a count, id, length, width, layer index, bucket or
token id asks `int_arg`; every one that takes a device asks `device_arg`; every allocation that
a user's sizes can make fail runs under `allocating`. So a bad argument is refused the same way
everywhere: a typed `BatchKVError` that names the argument, raised before anything changed.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator

import numpy as np
import torch

from batchkv.errors import BatchKVError, CapacityError, ConfigError

# Host allocators report failure as a RuntimeError with one of these (Linux/macOS, Windows).
_HOST_OOM = ("can't allocate memory", "not enough memory")


def is_int(value: object) -> bool:
    """An integer (Python or numpy), not a bool or a float that happens to equal one."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def int_arg(
    name: str,
    value: object,
    lo: int | None = None,
    hi: int | None = None,
    *,
    error: type[BatchKVError] = ConfigError,
    why: str = "",
) -> int:
    """`value` as a Python int in [lo, hi] (either bound optional), else `error` naming `name`.

    bool, float (even 2.0), str and None are refused: a count that arrives as 7.5 or True is a
    caller's mistake, and truncating it would hide the mistake.
    """
    if not is_int(value):
        raise error(f"{name} is {value!r} ({type(value).__name__}); it must be an integer{why}")
    number = int(value)  # type: ignore[call-overload]
    if (lo is not None and number < lo) or (hi is not None and number > hi):
        if lo is not None and hi is not None:
            bounds = f"in [{lo}, {hi}]"
        else:
            bounds = f">= {lo}" if lo is not None else f"<= {hi}"
        raise error(f"{name} is {number}; it must be {bounds}{why}")
    return number


def int_args(
    name: str,
    values: object,
    lo: int | None = None,
    hi: int | None = None,
    *,
    error: type[BatchKVError] = ConfigError,
) -> tuple[int, ...]:
    """A sequence of integers (a list, tuple, range, numpy array or tensor) as a tuple of Python
    ints, each checked by `int_arg` as `name[i]`; anything else is `error` naming `name`."""
    if hasattr(values, "tolist"):  # numpy array or tensor: its elements as Python numbers
        values = values.tolist()  # type: ignore[union-attr]
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise error(f"{name} is {values!r}; give a sequence of integers")
    if (  # plain ints in bounds, checked whole: a 2048-token prompt takes 0.2 ms, not 1.3 ms item by item
        isinstance(values, (list, tuple))
        and set(map(type, values)) <= {int}
        and (not values or ((lo is None or min(values) >= lo) and (hi is None or max(values) <= hi)))
    ):
        return tuple(values)
    return tuple(int_arg(f"{name}[{i}]", v, lo, hi, error=error) for i, v in enumerate(values))


def real_arg(name: str, value: object, *, error: type[BatchKVError] = ConfigError) -> float:
    """`value` as a finite float (an int is fine, a bool or str is not), else `error` naming `name`."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise error(f"{name} is {value!r} ({type(value).__name__}); it must be a number")
    number = float(value)
    if not math.isfinite(number):
        raise error(f"{name} is {number}; it must be finite")
    return number


def device_arg(device: object, what: str = "device") -> torch.device:
    """A `torch.device` that exists here, else ConfigError naming it.

    Refuses strings torch cannot parse ("tpu9"), CUDA on a torch without CUDA or a machine
    without a GPU, a CUDA index past the GPUs present, and any other backend this torch cannot
    allocate on. Host side, at construction only.
    """
    if not isinstance(device, (str, torch.device)):
        raise ConfigError(f"{what} is {device!r} ({type(device).__name__}); give a device such as 'cpu' or 'cuda'")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ConfigError(f"{what} {device!r} is not a device torch knows; use 'cpu' or 'cuda[:N]'") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = "this torch was built without CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
            raise ConfigError(f"{what} {str(dev)!r} is not available: {why}; use 'cpu'")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(
                f"{what} {str(dev)!r} is not available: this machine has {torch.cuda.device_count()} CUDA GPU(s)"
            )
    elif dev.type != "cpu":
        try:
            torch.empty(0, device=dev)
        except (RuntimeError, AssertionError, NotImplementedError):
            raise ConfigError(f"{what} {str(dev)!r} is not available with this torch build; use 'cpu'") from None
    return dev


def is_out_of_memory(exc: BaseException) -> bool:
    """True for a failed allocation: CUDA's `torch.OutOfMemoryError` or a host allocator's RuntimeError."""
    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and any(text in str(exc) for text in _HOST_OOM)
    )


@contextlib.contextmanager
def allocating(what: str, nbytes: int, fix: str) -> Iterator[None]:
    """Turn a failed allocation inside the block into `CapacityError` with the bytes asked for.

    `what` says what was being allocated, `fix` what to do; other errors pass through. The caller
    allocates before it publishes anything, so the refusal changes nothing.
    """
    try:
        yield
    except RuntimeError as exc:
        if not is_out_of_memory(exc):
            raise
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CapacityError(
            f"{what}: allocating {nbytes} bytes ({nbytes / 2**30:.2f} GiB) failed ({reason}); {fix}"
        ) from exc
