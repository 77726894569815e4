"""Typed refusals. Every error batchkv raises on purpose is a `BatchKVError`.

A refused call changes nothing: positions, histories and the standing declaration stay as they
were, so a caller can catch the error, fix the request and retry. Messages carry the numbers and
what to do about them.
"""

from __future__ import annotations


class BatchKVError(Exception):
    """Base of every refusal batchkv raises."""


class ConfigError(BatchKVError, ValueError):
    """A cache, model or executor configuration breaks a rule (the message names it)."""


class UnknownSequenceError(BatchKVError, LookupError):
    """A sequence id that `seq_new`/`seq_clone` did not hand out, or that was removed."""


class NoFreeColumnError(BatchKVError):
    """Every column is held; remove a sequence (`seq_rm`) or raise `max_seqs`."""


class CapacityError(BatchKVError):
    """A sequence would pass its per-sequence capacity, or a step its width/segment limits."""


class StepError(BatchKVError):
    """The step protocol was broken: declare -> prepare -> forward -> commit, in that order."""


class PositionError(BatchKVError, ValueError):
    """A length argument (rewind target, clone prefix) lies outside what the sequence holds."""


class RingFloorError(PositionError):
    """A rewind or clone would need positions a ring layer no longer holds."""


class ContractError(BatchKVError, ValueError):
    """Tensors handed to a kernel or the cache break the documented contract."""


class UnsupportedLayout(BatchKVError):
    """A manifest asks for a cache layout this runtime does not build."""


class ManifestError(BatchKVError, ValueError):
    """A manifest breaks the schema. `path` is the JSON path of the field (`$.layers[3].window`),
    `rule` what it must be; the message is `"<path>: <rule>"`."""

    def __init__(self, path: str, rule: str) -> None:
        super().__init__(f"{path}: {rule}")
        self.path = path
        self.rule = rule

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        return type(self), (self.path, self.rule)


class CheckpointError(BatchKVError, ValueError):
    """A checkpoint's tensors do not match the model: missing, unexpected or misshapen names."""


class RequestError(BatchKVError, ValueError):
    """A request the engine can never serve (empty prompt, no room under capacity, bad sampling
    parameters); it is refused at submit and the engine is unchanged."""


class DependencyError(BatchKVError, ImportError):
    """An optional dependency is missing or too old; the message names the extra to install."""


class WorkloadError(BatchKVError, ValueError):
    """A workload file breaks its schema (the message names the line, the field and the rule)."""


class TensorParallelError(BatchKVError, RuntimeError):
    """A tensor-parallel rank raised, died or stopped answering (the message names it and its error);
    the engine's processes have been stopped and it cannot step again: build a new engine."""


class EngineProcessError(BatchKVError, RuntimeError):
    """The server's engine process exited or failed (the message says how; its log has the detail):
    its requests end with this error and the server answers 503 until it is restarted."""
